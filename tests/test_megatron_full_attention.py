"""Megatron with a model mixing factorized and full-attention layers, against the plain-torch oracle.

Pattern ``(spatial, full, temporal, full)``: the full layer 2 runs on the T shard the
spatial layer leaves, the full layer 4 on the S shard after the temporal layer's
switch, so the head switch runs along both video dims. T = S = 6 over 4 DSP ranks
is uneven (2, 2, 1, 1); 4 heads over DSP=4 leaves one head per rank. Losses and
DDP's reduced ``main_grad`` over 3 SGD steps equal the oracle's (fp32, 1e-5), and
each full layer issues exactly two all-to-alls forward and two backward.

Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import global_losses, max_differences  # noqa: E402
from tests.megatron_full_attention import PATTERN, reference_run, run_layouts  # noqa: E402

STEPS = 3
TOLERANCE = 1e-5  # fp32
#: name -> (tp, dsp, pp, micro batch size, micro batches, recompute), on 4 ranks
LAYOUTS = {
    "DSP=4": (1, 4, 1, 2, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "PP=2 x DSP=2 + full recompute": (1, 2, 2, 1, 2, True),
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    names = list(LAYOUTS)
    per_rank = run_distributed(run_layouts, 4, [LAYOUTS[n] for n in names], STEPS, timeout=420)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run(STEPS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_model_trains_equal_to_one_process(results: dict, reference: dict, layout: str) -> None:
    per_rank = results[layout]
    loss_diff, grad_diff = max_differences(reference, per_rank)
    print(f"\n{layout}: losses {global_losses(per_rank)} vs {reference['losses']}; "
          f"max |loss diff| {loss_diff:.2e}, max |grad diff| {grad_diff:.2e}")
    assert loss_diff < TOLERANCE and grad_diff < TOLERANCE


def test_full_layers_are_built_and_switch_heads_twice_each_way(results: dict) -> None:
    for rank_result in results["DSP=4"]:
        assert rank_result["kinds"] == ["full" if kind == "full" else "factorized" for kind in PATTERN]
        dsp_all_to_all = [(op, phase) for op, size, phase in rank_result["collectives"] if op == "all_to_all"]
        # the temporal layer's switch (1 + 1) and the two full layers' head switches (2 + 2 each)
        assert dsp_all_to_all.count(("all_to_all", "forward")) == 1 + 2 * 2
        assert dsp_all_to_all.count(("all_to_all", "backward")) == 1 + 2 * 2


@pytest.mark.slow
def test_the_launch_trains_a_mixed_model_like_one_process() -> None:
    """``./launch/run_megatron.sh --dsp-attend-pattern spatial,full,temporal,full`` (torchrun, megatron.training's
    pretrain path on gloo) logs the losses of the same launch on one process without DSP."""
    from tests.megatron_launch import launch

    pattern = ("--dsp-attend-pattern", ",".join(PATTERN))
    dsp, _ = launch(*pattern, NPROC="2", DSP="2")
    single, _ = launch(*pattern, MODE="none", NPROC="1", DSP="1")
    print(f"\nlaunch losses, mixed model: DSP=2 {dsp}, one process {single}")
    assert sorted(dsp) == sorted(single) == [1, 2, 3]
    assert max(abs(dsp[i] - single[i]) for i in dsp) < TOLERANCE


def test_head_switch_core_attention_gqa_on_either_shard() -> None:
    """The core attention alone, GQA (4 heads, 2 groups) with uneven T = 5 and S = 3 on 2 ranks, sharded on T
    and on S: output and q, k, v gradients equal SDPA on the full tokens (fp64)."""
    from tests.megatron_full_attention import core_attention_case

    for diffs in run_distributed(core_attention_case, 2):
        assert max(diffs) < 1e-12, diffs
