"""Megatron with a model mixing factorized and full-attention layers, against the plain-torch oracle.

Pattern ``(spatial, full, temporal, full)``: the full layer 2 runs on the T shard the
spatial layer leaves, the full layer 4 on the S shard after the temporal layer's
switch, so the head switch runs along both video dims. T = S = 6 over 4 DSP ranks
is uneven (2, 2, 1, 1); 4 heads over DSP=4 leaves one head per rank. Losses and
DDP's reduced ``main_grad`` over 3 SGD steps equal the oracle's (fp32, 1e-5), and
each full layer issues exactly two all-to-alls forward and two backward.

With ``--position-embedding-type rope`` (variant ``mixed+rope``) the full layers rotate
q and k by each token's global ``(t, h, w)`` (3-D RoPE) and the temporal layer by its
frame: outputs, gradients and losses equal the oracle's within 1e-5 relative at DSP=2,
TP=2 x DSP=2 and PP=2 x DSP=2, as the factorized paper model does. Selective recompute
(``core_attn``) re-runs the full layers' core attention and its head switch in backward,
outside the layer's forward, and trains equal to the oracle too.

Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import (  # noqa: E402
    global_losses,
    max_differences,
    max_relative_differences,
    reference_run,
    run_variants,
)
from tests.megatron_full_attention import PATTERN, reference_model, two_ranks  # noqa: E402

STEPS = 3
TOLERANCE = 1e-5  # fp32
#: name -> (tp, dsp, pp, micro batch size, micro batches, recompute), on 4 ranks
LAYOUTS = {
    "DSP=4": (1, 4, 1, 2, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "TP=2 x DSP=2 + selective recompute": (2, 2, 1, 2, 1, "selective"),
    "PP=2 x DSP=2 + full recompute": (1, 2, 2, 1, 2, True),
}
#: with RoPE (3-D in the full layers); "DSP=2" runs on 2 ranks, the others on 4
ROPE_LAYOUTS = {
    "DSP=2": (1, 2, 1, 2, 1, False),
    "TP=2 x DSP=2": (2, 2, 1, 2, 1, False),
    "PP=2 x DSP=2": (1, 2, 2, 1, 2, False),
}
FOUR_RANK_ROPE = [name for name in ROPE_LAYOUTS if name != "DSP=2"]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """The 4-rank layouts of both variants in one spawn (importing megatron dominates the cost)."""
    groups = [("mixed", [LAYOUTS[n] for n in LAYOUTS]), ("mixed+rope", [ROPE_LAYOUTS[n] for n in FOUR_RANK_ROPE])]
    names = list(LAYOUTS) + [f"rope {n}" for n in FOUR_RANK_ROPE]
    per_rank = run_distributed(run_variants, 4, groups, STEPS, timeout=480)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def two_rank_results() -> dict:
    """The core attention alone and the RoPE model at DSP=2, in one 2-rank spawn."""
    per_rank = run_distributed(two_ranks, 2, [("mixed+rope", [ROPE_LAYOUTS["DSP=2"]])], STEPS, timeout=300)
    return {"core_attention": [r["core_attention"] for r in per_rank],
            "rope DSP=2": [r["layouts"][0] for r in per_rank]}


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run(STEPS, "mixed", oracle=reference_model)


@pytest.fixture(scope="module")
def rope_reference() -> dict:
    return reference_run(STEPS, "mixed+rope", oracle=reference_model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_model_trains_equal_to_one_process(results: dict, reference: dict, layout: str) -> None:
    per_rank = results[layout]
    loss_diff, grad_diff = max_differences(reference, per_rank)
    print(f"\n{layout}: losses {global_losses(per_rank)} vs {reference['losses']}; "
          f"max |loss diff| {loss_diff:.2e}, max |grad diff| {grad_diff:.2e}")
    assert loss_diff < TOLERANCE and grad_diff < TOLERANCE


@pytest.mark.parametrize("layout", list(ROPE_LAYOUTS))
def test_full_layers_with_rope_equal_the_oracle(results: dict, two_rank_results: dict, rope_reference: dict,
                                                layout: str) -> None:
    """``--position-embedding-type rope`` with full layers: 3-D RoPE from each token's global (t, h, w)."""
    per_rank = (two_rank_results if layout == "DSP=2" else results)[f"rope {layout}"]
    diffs = max_relative_differences(rope_reference, per_rank, ROPE_LAYOUTS[layout][3])
    print(f"\nmixed+rope {layout}: max relative diff outputs {diffs['outputs']:.1e}, grads {diffs['grads']:.1e}, "
          f"losses {diffs['losses']:.1e}")
    assert max(diffs.values()) < TOLERANCE, (layout, diffs)


def test_the_rope_oracle_rotates() -> None:
    """The oracle's 3-D RoPE is not a no-op: the same model without it trains to other losses."""
    def without_rope(config):
        model = reference_model(config)
        for block in model.blocks:
            if getattr(block, "patch_grid", None):
                block.rope = False
        return model

    rotated, plain = reference_run(1, "mixed+rope", reference_model), reference_run(1, "mixed+rope", without_rope)
    assert abs(rotated["losses"][0] - plain["losses"][0]) > 1e-4, (rotated["losses"], plain["losses"])


def test_full_layers_are_built_and_switch_heads_twice_each_way(results: dict) -> None:
    for rank_result in results["DSP=4"]:
        assert rank_result["kinds"] == ["full" if kind == "full" else "factorized" for kind in PATTERN]
        dsp_all_to_all = [(op, phase) for op, size, phase in rank_result["collectives"] if op == "all_to_all"]
        # the temporal layer's switch (1 + 1) and the two full layers' head switches (2 + 2 each)
        assert dsp_all_to_all.count(("all_to_all", "forward")) == 1 + 2 * 2
        assert dsp_all_to_all.count(("all_to_all", "backward")) == 1 + 2 * 2


def test_selective_recompute_reruns_the_head_switch_in_backward(results: dict) -> None:
    """``core_attn`` recompute re-runs each full layer's core attention (its 2 head switches) in backward,
    outside the layer's forward: the grid travels in the core attention's arguments, so it finds it."""
    def counts(result: dict) -> tuple[int, int]:
        return tuple(sum(1 for op, size, ph in result["collectives"] if op == "all_to_all" and size == 2
                         and ph == phase) for phase in ("forward", "backward"))

    for plain, selective in zip(results["TP=2 x DSP=2"], results["TP=2 x DSP=2 + selective recompute"],
                                strict=True):
        assert counts(plain) == (1 + 2 * 2, 1 + 2 * 2)
        assert counts(selective) == (1 + 2 * 2, 1 + 2 * 2 + 2 * 2)


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


def test_head_switch_core_attention_gqa_on_either_shard(two_rank_results: dict) -> None:
    """The core attention alone, GQA (4 heads, 2 groups) with uneven T = 5 and S = 3 on 2 ranks, sharded on T
    and on S: output and q, k, v gradients equal SDPA on the full tokens (fp64)."""
    for diffs in two_rank_results["core_attention"]:
        assert max(diffs) < 1e-12, diffs
