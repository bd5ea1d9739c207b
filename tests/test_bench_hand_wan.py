"""The costs section's A/B baseline (``dsp_plugin.bench.wan.hand_parallel``): the Wan made parallel by hand computes
what the plan's Wan and one process compute, so the A/B compares equal work; and the A/B (``bench.costs``) runs and
reports.

Nothing here reads a time: timings are the bench's output, never a test's pass condition.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsp_plugin.bench.wan import QUICK
from tests.distributed import run_distributed

SIZE = (2, 4, 8, 4, 8)  # the quick Wan: 64 tokens, 4 heads; 4 frames over 2 ranks


def _outputs(rank: int, world_size: int, size: tuple[int, ...]) -> dict[str, float]:
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup, hand_parallel

    reference, batch = _setup(size)
    group = torch.distributed.group.WORLD  # no topology installed: the plan and the hand get the group explicitly
    plan = dsp_plugin.parallelize(copy.deepcopy(reference), group=group)
    hand, running = hand_parallel(reference, size, group=group)
    with torch.no_grad():
        expected = reference(*batch, return_dict=False)[0]
        got_plan = plan(*batch, return_dict=False)[0]
        with running():
            got_hand = hand(*batch, return_dict=False)[0]
        again = plan(*batch, return_dict=False)[0]  # the hand's context left diffusers' dispatch as it was
    return {"hand": (got_hand - expected).abs().max().item(), "plan": (got_plan - expected).abs().max().item(),
            "again": (again - expected).abs().max().item(), "shape": list(got_hand.shape) == list(expected.shape)}


def test_hand_written_wan_computes_the_one_process_output() -> None:
    assert SIZE == QUICK
    for rank, r in enumerate(run_distributed(_outputs, 2, SIZE, world_topology=False)):
        assert r["shape"], r
        for key in ("hand", "plan", "again"):
            assert r[key] < 1e-5, (rank, key, r)


def test_against_hand_runs_and_prints_its_row() -> None:
    from dsp_plugin.bench import costs

    result = costs.measure_against_hand(2, SIZE, rounds=2, per_round=1)
    table = costs.ab_markdown(result)
    print(table)
    assert result["n"] == 2 and result["size"] == SIZE and result["rounds"] == 2
    assert 0 < result["plan_min_ms"] <= result["plan_ms"] and 0 < result["hand_min_ms"] <= result["hand_ms"]
    assert "| 2, 4 x 8, 64 | 2, 2 |" in table
    assert not torch.distributed.is_initialized()  # the fake world is torn down
    assert "forward CPU ms" in table


def test_against_hand_times_a_training_step_too() -> None:
    from dsp_plugin.bench import costs

    result = costs.measure_against_hand(2, SIZE, rounds=2, per_round=1, backward=True)
    assert result["backward"] and "forward + backward CPU ms" in costs.ab_markdown(result)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda:0'; expected 'cpu' or a CUDA device"):
            costs.measure_against_hand(2, SIZE, device="cuda:0")


def test_the_paired_estimate_has_an_interval_around_it() -> None:
    from dsp_plugin.bench.costs import median_interval

    assert median_interval([0.5] * 30) == (0.5, 0.5)
    values = [float(v % 7) for v in range(41)]  # median 3
    low, high = median_interval(values)
    assert low <= 3.0 <= high and low < high
    assert median_interval(values) == (low, high)  # seeded: a table is reproducible from its times


def test_against_hand_on_gloo_ranks_and_against_itself() -> None:
    """The A/B on the bench's own setting (2 gloo ranks, real collectives) and its A/A control (the plan's Wan
    against a second copy of itself) run and report the paired estimate with its interval."""
    from dsp_plugin.bench import costs

    result = costs.measure_against_hand(2, SIZE, rounds=2, per_round=1, world="gloo")
    table = costs.ab_markdown(result)
    assert result["world"] == "gloo" and "| 2, 4 x 8, 64 | 2, 2 |" in table and "N (gloo)" in table
    low, high = result["paired_interval"]
    assert low <= result["paired_share"] <= high
    control = costs.ab_markdown(costs.measure_against_hand(2, SIZE, rounds=2, per_round=1, control=True))
    assert "a second plan copy (A/A)" in control and "N (fake)" in control
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="world='nccl' on device='cpu'; expected 'fake', or 'gloo'"):
        costs.measure_against_hand(2, SIZE, world="nccl")


def test_a_fake_world_learns_what_a_real_one_does() -> None:
    """The A/B's backward compares equal work: in a fake world (torch's ``fake`` process group, whose all_reduce
    sums nothing) rank 0 stands for every rank, so no parameter the model uses counts as used by some ranks only
    (``every_gradient``'s zeros, one tensor per such parameter per backward, which the hand-written model lacks)."""
    import dsp_plugin
    from dsp_plugin import every_gradient
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.fake_world import fake_world

    with fake_world(2, dsp=2):
        reference, batch = _setup(SIZE)
        model = dsp_plugin.parallelize(reference)
        model(*batch, return_dict=False)[0].square().mean().backward()
        states = [h.__self__ for h in model._forward_pre_hooks.values()
                  if isinstance(getattr(h, "__self__", None), every_gradient._State)]
        assert len(states) == 1 and states[0].late == set(), states[0].late
        assert all(p.grad is not None for p in model.parameters())
