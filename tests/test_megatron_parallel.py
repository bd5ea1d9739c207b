"""Megatron + DSP on 2 and 4 gloo ranks equals the single-process run: losses and gradients over 3 steps.

Layouts: DSP=2 (2 ranks); DSP=4, DSP=2 x DP=2, TP=2 x DSP=2, PP=2 x DSP=2 (two micro-batches),
TP=2 x DSP=2 with Megatron's sequence parallelism on 4 ranks, all on
real megatron-core (parallel_state with DSP in the CP slot, TransformerLayers,
DDP averaging over DP x CP, the pipeline schedules, finalize_model_grads). The
gradient compared is DDP's reduced ``main_grad``, so this pins the convention:
Megatron scales the loss by the CP (= DSP) size and averages over DP x CP, which
is SUM over DSP and MEAN over DP. T = S = 6 split over 4 ranks is uneven (2,2,1,1).

Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import (  # noqa: E402
    COMPOSITIONS,
    REFERENCE,
    TWO_RANK_COMPOSITIONS,
    global_losses,
    max_differences,
    run_layouts,
)

pytestmark = pytest.mark.slow

STEPS = 3
#: tp 2 x dsp 4 cannot fit 4 ranks: every rank must raise while parsing, before any collective
BAD_ARGV = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
            "--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--tensor-model-parallel-size", "2"]
TOLERANCE = 1e-5  # fp32


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_layouts, 1, [REFERENCE], STEPS, timeout=300)[0][0]


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    """All layouts in one spawn of 4 ranks (importing megatron dominates the cost)."""
    names = list(COMPOSITIONS)
    per_rank = run_distributed(run_layouts, 4, [COMPOSITIONS[n] for n in names], STEPS, BAD_ARGV, timeout=420)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def all_layouts(four_ranks: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The 4-rank layouts plus DSP=2 alone on 2 ranks."""
    names = list(TWO_RANK_COMPOSITIONS)
    per_rank = run_distributed(run_layouts, 2, [TWO_RANK_COMPOSITIONS[n] for n in names], STEPS, timeout=300)
    two = {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}
    return two | four_ranks


LAYOUTS = {**TWO_RANK_COMPOSITIONS, **COMPOSITIONS}


def test_reference_trains(reference: dict) -> None:
    """The oracle itself moves: three different losses, so equality below means something."""
    losses = global_losses([reference])
    assert len(set(losses)) == STEPS and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name: str, reference: dict, all_layouts: dict) -> None:
    loss_diff, grad_diff = max_differences([reference], all_layouts[name])
    print(f"\n{name}: max |loss - DSP=1| = {loss_diff:.2e}, max |grad - DSP=1| = {grad_diff:.2e}")
    assert loss_diff < TOLERANCE, f"{name}: loss differs from DSP=1 by {loss_diff}"
    assert grad_diff < TOLERANCE, f"{name}: gradient differs from DSP=1 by {grad_diff}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_switch_per_block_boundary(name: str, all_layouts: dict) -> None:
    """Each block but the first is entered through exactly one DSP all-to-all, and its adjoint."""
    _, _, _, _, num_microbatches, _ = LAYOUTS[name]
    for result in all_layouts[name]:
        switched_blocks = result["stage_layers"] - (1 if result["first_stage"] else 0)
        expected = switched_blocks * num_microbatches
        assert result["switches"] == (expected, expected), (name, result["switches"], expected)


def test_bad_arguments_raise_on_every_rank(four_ranks: dict) -> None:
    """All 4 ranks raise the same message locally; none is left waiting (the spawn then goes on)."""
    errors = [result["bad_args_error"] for result in next(iter(four_ranks.values()))]
    assert len(errors) == 4
    assert all(e == errors[0] for e in errors), errors
    assert "world size (4) is not divisible by tensor model parallel size (2) x dsp size (4)" in errors[0]
