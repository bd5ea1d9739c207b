"""Megatron + DSP on 2 and 4 gloo ranks against the plain-torch oracle: losses and gradients over 3 steps.

The oracle is ``dsp_plugin.models.stdit.STDiT`` trained with torch SGD on the whole
global batch in this process (``megatron_compositions.reference_run``), sharing no
code path with the Megatron model except the weights it is drawn with. Layouts:
DSP=2 without and with full recompute (uniform with 1 and 2 layers per chunk, block; 2 ranks);
DSP=4, DSP=2 x DP=2, TP=2 x DSP=2 (also with full recompute and ``--distribute-saved-activations``, whose
checkpoint re-gathers its input into new memory before the recompute), PP=2 x DSP=2 (two micro-batches) on
4 ranks, all on real megatron-core (a stock
``TransformerBlock`` of DSP layers, DDP over DP x CP, the pipeline schedules,
``finalize_model_grads``). The gradient compared is DDP's reduced ``main_grad``, so
this pins the convention: SUM over DSP, MEAN over DP. T = S = 6 over 4 ranks is
uneven (2,2,1,1). Every layer has cross-attention to a text embedding.

Run with ``-s`` to see the measured differences and all-to-all counts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import (  # noqa: E402
    COMPOSITIONS,
    TWO_RANK_COMPOSITIONS,
    global_losses,
    max_differences,
    reference_run,
    run_layouts,
)

pytestmark = pytest.mark.slow

STEPS = 3
#: tp 2 x dsp 4 cannot fit 4 ranks: every rank must raise while parsing, before any collective
BAD_ARGV = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
            "--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--tensor-model-parallel-size", "2"]
TOLERANCE = 1e-5  # fp32
LAYOUTS = {**TWO_RANK_COMPOSITIONS, **COMPOSITIONS}


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run(STEPS)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    """All 4-rank layouts in one spawn (importing megatron dominates the cost)."""
    names = list(COMPOSITIONS)
    per_rank = run_distributed(run_layouts, 4, [COMPOSITIONS[n] for n in names], STEPS, BAD_ARGV, timeout=420)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def all_layouts(four_ranks: dict[str, list[dict]]) -> dict[str, list[dict]]:
    names = list(TWO_RANK_COMPOSITIONS)
    per_rank = run_distributed(run_layouts, 2, [TWO_RANK_COMPOSITIONS[n] for n in names], STEPS, timeout=300)
    two = {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}
    return two | four_ranks


def test_reference_trains(reference: dict) -> None:
    """The oracle itself moves: three different losses, so equality below means something."""
    losses = reference["losses"]
    assert len(set(losses)) == STEPS and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_plain_torch_reference(name: str, reference: dict, all_layouts: dict) -> None:
    loss_diff, grad_diff = max_differences(reference, all_layouts[name])
    print(f"\n{name}: max |loss - reference| = {loss_diff:.2e}, max |grad - reference| = {grad_diff:.2e}")
    assert loss_diff < TOLERANCE, f"{name}: loss differs from the plain-torch reference by {loss_diff}"
    assert grad_diff < TOLERANCE, f"{name}: gradient differs from the plain-torch reference by {grad_diff}"


def _all_to_alls(result: dict, dsp: int, phase: str) -> int:
    return sum(1 for op, size, ph in result["collectives"] if op == "all_to_all" and size == dsp and ph == phase)


def _replayed_switches(recompute: object, stage_layers: int, switched: int) -> int:
    """Switches a full recompute issues again in backward: under ``uniform`` with k layers per chunk, those of
    the layers inside a chunk (their input is recomputed, so recompute.py has no kept output to reuse); none
    under ``block`` or 1 layer per chunk, where every checkpointed switch leads its chunk; every one with
    distributed saved activations (asked to save memory, recompute.py keeps no switch output)."""
    if recompute == "distributed":
        return switched
    if isinstance(recompute, tuple) and recompute[0] == "uniform":
        return sum(1 for index in range(stage_layers) if index % recompute[1])
    return 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_switch_per_block_boundary(name: str, all_layouts: dict) -> None:
    """Each layer but the first is entered through exactly one DSP all-to-all, and its adjoint;
    cross-attention (local queries, replicated text) adds none, and full recompute replays none
    (but the switches inside a multi-layer ``uniform`` chunk, see ``_replayed_switches``)."""
    tp, dsp, _, _, num_microbatches, recompute = LAYOUTS[name]
    for result in all_layouts[name]:
        switched = result["stage_layers"] - (1 if result["first_stage"] else 0)
        expected = switched * num_microbatches
        replayed = _replayed_switches(recompute, result["stage_layers"], switched) * num_microbatches
        forward, backward = _all_to_alls(result, dsp, "forward"), _all_to_alls(result, dsp, "backward")
        assert forward == expected, f"{name}: {forward} forward all-to-alls, expected {expected} (one per switch)"
        assert backward == expected + replayed, \
            f"{name}: {backward} backward all-to-alls, expected {expected} adjoints + {replayed} replayed switches" \
            f"{' (the recompute replayed a switch it should have reused)' if backward > expected + replayed else ''}"
        if tp == 1 and dsp == 4:  # the DSP group is no other group: besides the switches only DDP's reduction
            others = {c[0] for c in result["collectives"] if c[1] == dsp and c[0] != "all_to_all"}
            assert others <= {"all_reduce"}, (name, others)


@pytest.mark.parametrize("plain_name, recompute_name", [
    ("DSP=2", "DSP=2 + full recompute"), ("DSP=2", "DSP=2 + full recompute block 2"),
    ("DSP=2", "DSP=2 + full recompute uniform 2"), ("PP=2 x DSP=2", "PP=2 x DSP=2 + full recompute"),
    ("TP=2 x DSP=2", "TP=2 x DSP=2 + full recompute, distributed saved activations")])
def test_full_recompute_same_losses_and_no_replayed_switch(plain_name: str, recompute_name: str,
                                                           all_layouts: dict) -> None:
    """``recompute_granularity=full`` through TransformerBlock (``uniform`` with 1 and 2 layers per chunk,
    ``block`` with 2 checkpointed layers): the same losses, and the recompute reuses each chunk-leading
    layer's switch output instead of issuing the all-to-all again (recompute.py); with PP, two micro-batches
    wait for their recompute at once."""
    plain, recompute = all_layouts[plain_name], all_layouts[recompute_name]
    # the checkpoint hands the conditioning's gradient back per chunk: another summation order
    assert max(abs(a - b) for a, b in zip(global_losses(plain), global_losses(recompute), strict=True)) < 1e-6
    num_microbatches, method = LAYOUTS[recompute_name][4:]
    for a, b in zip(plain, recompute, strict=True):
        counts = [(_all_to_alls(r, 2, "forward"), _all_to_alls(r, 2, "backward")) for r in (a, b)]
        print(f"\n{recompute_name} all-to-alls per step on this rank (fwd, bwd): without recompute {counts[0]}, "
              f"with full recompute {counts[1]}")
        switched = b["stage_layers"] - (1 if b["first_stage"] else 0)
        replayed = _replayed_switches(method, b["stage_layers"], switched) * num_microbatches
        assert counts[1] == (counts[0][0], counts[0][1] + replayed), \
            f"{recompute_name}: all-to-alls (forward, backward) {counts[1]}, expected {counts[0]} as without " \
            f"recompute, + {replayed} replayed in backward: the recompute replayed a switch it should have reused"


def test_bad_arguments_raise_on_every_rank(four_ranks: dict) -> None:
    """All 4 ranks raise the same message locally; none is left waiting (the spawn then goes on)."""
    errors = [result["bad_args_error"] for result in next(iter(four_ranks.values()))]
    assert len(errors) == 4
    assert all(e == errors[0] for e in errors), errors
    assert "world size (4) is not divisible by tensor model parallel size (2) x dsp size (4)" in errors[0]
