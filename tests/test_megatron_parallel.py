"""Megatron + DSP on 4 gloo ranks equals the single-process run: losses and gradients over 3 steps.

Layouts: DSP=4, DSP=2 x DP=2, TP=2 x DSP=2, PP=2 x DSP=2 (two micro-batches), all on
real megatron-core (parallel_state with DSP in the CP slot, TransformerLayers,
DDP averaging over DP x CP, the pipeline schedules, finalize_model_grads). The
gradient compared is DDP's reduced ``main_grad``, so this pins the convention:
Megatron scales the loss by the CP (= DSP) size and averages over DP x CP, which
is SUM over DSP and MEAN over DP. T = S = 6 split over 4 ranks is uneven (2,2,1,1).

Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_compositions import COMPOSITIONS, REFERENCE, max_differences, run_layouts

pytest.importorskip("megatron.core")

STEPS = 3
TOLERANCE = 1e-5  # fp32


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_layouts, 1, [REFERENCE], STEPS, timeout=300)[0][0]


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    """All layouts in one spawn of 4 ranks (importing megatron dominates the cost)."""
    names = list(COMPOSITIONS)
    per_rank = run_distributed(run_layouts, 4, [COMPOSITIONS[n] for n in names], STEPS, timeout=420)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}


def test_reference_trains(reference: dict) -> None:
    """The oracle itself moves: three different losses, so equality below means something."""
    losses = reference["losses"]
    assert len(set(losses)) == STEPS and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_layout_matches_single_process(name: str, reference: dict, four_ranks: dict) -> None:
    loss_diff, grad_diff = max_differences([reference], four_ranks[name])
    print(f"\n{name}: max |loss - DSP=1| = {loss_diff:.2e}, max |grad - DSP=1| = {grad_diff:.2e}")
    assert loss_diff < TOLERANCE, f"{name}: loss differs from DSP=1 by {loss_diff}"
    assert grad_diff < TOLERANCE, f"{name}: gradient differs from DSP=1 by {grad_diff}"


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_one_switch_per_block_boundary(name: str, four_ranks: dict) -> None:
    """Each block but the first is entered through exactly one DSP all-to-all, and its adjoint."""
    _, _, _, _, num_microbatches, _ = COMPOSITIONS[name]
    for result in four_ranks[name]:
        switched_blocks = result["stage_layers"] - (1 if result["first_stage"] else 0)
        expected = switched_blocks * num_microbatches
        assert result["switches"] == (expected, expected), (name, result["switches"], expected)
