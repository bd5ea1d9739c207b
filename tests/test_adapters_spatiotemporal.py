"""The second family: diffusers' TransformerSpatioTemporalModel (SVD) under DSP equals the unmodified model.

Oracle: the diffusers module's own forward on one process. 7 frames (uneven on
2 and 4 ranks), 4x4 pixels; forward output, input gradient and parameter
gradients summed over the group (the project's convention: ``reduce_gradients``,
and an all_reduce of the input gradient). The model is parallelized by its
built-in plan (hooks); ``SpatioTemporalDSP`` wraps it.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.adapters.spatiotemporal import SpatioTemporalDSP  # noqa: E402
from dsp_plugin.checks import check_mode  # noqa: E402
from dsp_plugin.testing.tiny import tiny_spatiotemporal  # noqa: E402
from tests.distributed import assert_no_steady_state_checks, run_distributed  # noqa: E402

B, F, C, H, W, LAYERS = 2, 7, 32, 4, 4, 2


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    indicator = torch.zeros(B, F)
    indicator[1] = 1.0                      # the second sample is "images only": the mixer takes spatial
    return (torch.randn(B * F, C, H, W, generator=g), torch.randn(B * F, 3, 16, generator=g), indicator,
            torch.randn(B * F, C, H, W, generator=g))


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x, text, indicator, target = _batch()
    x.requires_grad_(True)
    out = model(x, encoder_hidden_states=text, image_only_indicator=indicator, return_dict=False)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    return out.detach(), x.grad, {k.removeprefix("model."): p.grad for k, p in model.named_parameters()
                                  if p.grad is not None}


def _compare(model: torch.nn.Module, reference: tuple) -> dict[str, float]:
    with CommAccounting(activations=False) as acct:
        out, dx, grads = _run(model)
    reduce_gradients(model.parameters())
    if dist.is_initialized():
        dist.all_reduce(dx)
    grads = {k.removeprefix("model."): p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    with CommAccounting(activations=False) as steady:      # the same step again: nothing is new
        _run(model)
    out_ref, dx_ref, g_ref = reference
    assert grads.keys() == g_ref.keys(), sorted(grads.keys() ^ g_ref.keys())
    return {"out": (out - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item(),
            "grads": max((grads[k] - g_ref[k]).abs().max().item() for k in g_ref),
            "all_to_all": acct.count("all_to_all", "forward"),
            "steady_checks": [(r.op, r.group_ranks) for r in steady.check_records], "check_mode": check_mode()}


def _parallel(rank: int, n: int) -> dict[str, float]:
    reference = tiny_spatiotemporal(layers=LAYERS)
    return _compare(SpatioTemporalDSP(copy.deepcopy(reference)), _run(reference))


def test_single_process_equals_unmodified_model() -> None:
    reference = tiny_spatiotemporal(layers=LAYERS)
    d = _compare(SpatioTemporalDSP(copy.deepcopy(reference)), _run(reference))
    assert max(d["out"], d["dx"], d["grads"]) < 1e-5, d


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_equals_unmodified_model(n: int) -> None:
    for rank, d in enumerate(run_distributed(_parallel, n)):
        print(f"n={n} rank {rank}: {d}")
        assert max(d["out"], d["dx"], d["grads"]) < 1e-5, (rank, d)
        # a switch to pixels after each spatial block and back before the next; the exit gathers pixels
        assert d["all_to_all"] == 2 * LAYERS - 1, d
        assert_no_steady_state_checks(d["steady_checks"], d["check_mode"], f"SpatioTemporalDSP, rank {rank}/{n}")


def test_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match="expected a diffusers TransformerSpatioTemporalModel, got Linear"):
        SpatioTemporalDSP(torch.nn.Linear(2, 2))


def _through_parallelize(rank: int, n: int) -> dict[str, float]:
    import dsp_plugin

    reference = tiny_spatiotemporal(layers=LAYERS)
    model = copy.deepcopy(reference)
    # the spatial blocks recomputed in backward, as the enclosing UNet's enable_gradient_checkpointing() sets it
    model.gradient_checkpointing = True
    model._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    assert dsp_plugin.parallelize(model) is model        # the built-in plan, hooks in place
    return _compare(model, _run(reference))


def test_parallelize_finds_the_builtin_plan() -> None:
    """``dsp_plugin.parallelize`` on the model, under its own gradient checkpointing, 2 ranks."""
    for rank, d in enumerate(run_distributed(_through_parallelize, 2)):
        print(f"ckpt rank {rank}: {d}")
        assert max(d["out"], d["dx"], d["grads"]) < 1e-5, (rank, d)
        assert d["all_to_all"] == 2 * LAYERS - 1, d
