"""The tiny STDiT under DSP against the same model in one process (fp32, 1e-5).

Checked per world size: outputs, input gradients (summed over the group: partial per rank under
``parallelize``), every parameter gradient after
``reduce_gradients`` (sum over the DSP group), and the loss over three optimizer
steps; for the 2-axis model (even and uneven T, S) and the 3-axis model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsp_plugin import parallelize, reduce_gradients
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.checks import check_mode
from dsp_plugin.models import STDiT, STDiTConfig, switch_schedule
from tests.distributed import assert_no_steady_state_checks, run_distributed

TOL = 1e-5

# name -> (config overrides, latents shape [B, C, T, H, W])
CASES = {
    "2d-even": ({}, (2, 4, 8, 8, 8)),           # T=8, S=16
    "2d-uneven": ({}, (1, 4, 7, 26, 2)),        # T=7, S=13
    "3d-uneven": ({"axes": 3}, (1, 4, 5, 6, 10)),  # T=5, H'=3, W'=5
}


def _inputs(shape: tuple[int, ...], step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)
    latents = torch.randn(shape, generator=g)
    timestep = torch.randint(0, 1000, (shape[0],), generator=g)
    text = torch.randn(shape[0], 3, 16, generator=g)
    target = torch.randn(shape, generator=g)
    return latents, timestep, text, target


def _compare(rank: int, n: int, case: str) -> dict[str, float]:
    overrides, shape = CASES[case]
    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny", **overrides))
    model = parallelize(copy.deepcopy(reference))
    # SGD: an update is linear in the gradient, so parameters stay comparable at fp32
    # tolerance (Adam divides near-zero gradients by their own size, amplifying rounding).
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diffs = {"output": 0.0, "input_grad": 0.0, "param_grad": 0.0, "loss": 0.0, "param_after": 0.0}
    losses = []
    for step in range(3):
        latents, timestep, text, target = _inputs(shape, 0)  # one batch: the loss must fall
        outs, grads, loss_values = [], [], []
        for net, opt_ in ((reference, opt_ref), (model, opt)):
            x = latents.clone().requires_grad_(True)
            out = net(x, timestep, text)
            loss = torch.nn.functional.mse_loss(out, target)
            opt_.zero_grad()
            loss.backward()
            if net is model:
                reduce_gradients(model.parameters())
                # parallelize's convention: a replicated input's gradient is partial, summed over the DSP group
                torch.distributed.all_reduce(x.grad)
            outs.append((out.detach(), x.grad))
            grads.append({k: p.grad.clone() for k, p in net.named_parameters()})
            loss_values.append(loss.item())
            opt_.step()
        (out_ref, xg_ref), (out_dsp, xg_dsp) = outs
        diffs["output"] = max(diffs["output"], (out_ref - out_dsp).abs().max().item())
        diffs["input_grad"] = max(diffs["input_grad"], (xg_ref - xg_dsp).abs().max().item())
        for name, g in grads[0].items():
            diffs["param_grad"] = max(diffs["param_grad"], (g - grads[1][name]).abs().max().item())
        diffs["loss"] = max(diffs["loss"], abs(loss_values[0] - loss_values[1]))
        losses.append(loss_values)
    # parameters after three steps agree too
    for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
        diffs["param_after"] = max(diffs["param_after"], (p_ref - p).abs().max().item())
    diffs["losses"] = losses  # type: ignore[assignment]
    return diffs


def _comm_per_layer(rank: int, n: int) -> dict[str, object]:
    """Collectives of one forward+backward of the 2D model, depth 3, even shape."""
    shape = CASES["2d-even"][1]
    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny", depth=3))
    model = parallelize(copy.deepcopy(reference))
    latents, timestep, text, target = _inputs(shape, 0)
    with CommAccounting() as ref_acct:
        torch.nn.functional.mse_loss(reference(latents, timestep, text), target).backward()
    with CommAccounting() as acct:
        torch.nn.functional.mse_loss(model(latents, timestep, text), target).backward()
    with CommAccounting(activations=False) as steady:   # the next step: every signature and length known
        torch.nn.functional.mse_loss(model(latents, timestep, text), target).backward()
    return {
        "ops": [(r.op, r.phase) for r in acct.records],
        "steady_ops": [(r.op, r.phase) for r in steady.records],
        "steady_checks": [(r.op, r.group_ranks) for r in steady.check_records],
        "check_mode": check_mode(),
        "all_to_all_sent": [r.bytes_sent for r in acct.select("all_to_all")],
        "saved": acct.saved_activation_bytes,
        "saved_single": ref_acct.saved_activation_bytes,
    }


def _all_checks(rank: int, n: int) -> dict[str, object]:
    return {"cases": {case: _compare(rank, n, case) for case in CASES}, "comm": _comm_per_layer(rank, n)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N={n}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, object]]]:
    """One spawn per world size runs every case (spawning dominates the cost on CPU)."""
    return request.param, run_distributed(_all_checks, request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dsp_matches_single_process(results: tuple[int, list[dict]], case: str) -> None:
    for rank, per_rank in enumerate(results[1]):
        d = per_rank["cases"][case]
        for key in ("output", "input_grad", "param_grad", "loss", "param_after"):
            assert d[key] < TOL, f"rank {rank} {case}: {key} differs by {d[key]:.3g}"
        ref_curve = [a for a, _ in d["losses"]]
        assert ref_curve[2] < ref_curve[1] < ref_curve[0], f"loss should fall on a fixed batch: {ref_curve}"


def test_two_all_to_alls_per_layer_with_the_formula_bytes(results: tuple[int, list[dict]]) -> None:
    n, per_rank = results
    b, _, t, h, w = CASES["2d-even"][1]
    m = b * t * (h // 2) * (w // 2) * 32 * 4          # bytes of the full [B, T, S, D] fp32 activation
    depth = 3
    switches = 2 * depth - 1                            # the split lands on T, so layer 0 needs one
    for comm in (r["comm"] for r in per_rank):
        ops = comm["ops"]
        assert ops.count(("all_to_all", "forward")) == switches
        assert ops.count(("all_to_all", "backward")) == switches
        assert ops.count(("all_gather", "forward")) == 1   # the exit gather; nothing else
        assert len(ops) == 2 * switches + 1
        assert comm["all_to_all_sent"] == [m * (n - 1) // n**2] * (2 * switches)
        assert comm["steady_ops"] == ops
        assert_no_steady_state_checks(comm["steady_checks"], comm["check_mode"], "the parallelized STDiT")


def test_activation_memory_is_sharded(results: tuple[int, list[dict]]) -> None:
    n, per_rank = results
    for comm in (r["comm"] for r in per_rank):
        # replicated pieces (timestep and text embeddings, the exit gather) keep it above 1/N
        assert comm["saved"] < comm["saved_single"] * (1 / n + 0.25), (comm["saved"], comm["saved_single"])


def test_schedule_two_axes_is_one_switch_per_block() -> None:
    model = STDiT(STDiTConfig.preset("tiny", depth=3))
    attend = [b.attend_dim for b in model.blocks]
    schedule, final = switch_schedule(attend, model.sequence_dims, first_shard=1)
    # spatial blocks (attend S=2) run on S(1); temporal ones on S(2): the first block needs no switch
    assert schedule == [None, (1, 2), (2, 1), (1, 2), (2, 1), (1, 2)]
    assert final == 2


def test_schedule_three_axes_skips_switches() -> None:
    model = STDiT(STDiTConfig.preset("tiny", axes=3, depth=2))
    attend = [b.attend_dim for b in model.blocks]          # H', W', T per layer
    schedule, _ = switch_schedule(attend, model.sequence_dims, first_shard=1)
    assert attend == [2, 3, 1, 2, 3, 1]
    assert sum(s is not None for s in schedule) == 2       # 1 per 3 blocks instead of 1 per block


def test_presets_have_the_papers_sizes() -> None:
    assert (STDiTConfig.preset("720M").depth, STDiTConfig.preset("720M").hidden_size,
            STDiTConfig.preset("720M").num_heads) == (28, 1152, 16)
    assert (STDiTConfig.preset("3B").depth, STDiTConfig.preset("3B").hidden_size,
            STDiTConfig.preset("3B").num_heads) == (36, 2048, 32)
    with pytest.raises(ValueError, match="unknown STDiT preset 'huge'"):
        STDiTConfig.preset("huge")
