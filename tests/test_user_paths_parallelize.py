"""``dsp_plugin.parallelize`` with every built-in plan, called every way a user calls it (issue 25's matrix).

One 4-rank spawn loops over the group styles of ``tests.user_paths`` (an explicit group with
no topology, an explicit pair with none or under a world topology, an installed world topology,
DSP=2 x DP=2) and, in each, over the built-in plans: Wan (full 3D, head switch), CogVideoX (joint
attention), Latte and SVD (factorized), the reference STDiT; one spawn per diffusers attention
backend (``tests.user_paths.BACKENDS``: native, math, flex forward-only, one that calls no SDPA).
Oracle: the unmodified model on one process, fp64, on the DSP group's own batch. Output, input
gradient and parameter gradients summed over the DSP group (the project's convention) within 1e-9
(Wan's fp32 adaLN: 5e-9); a deep copy of the parallelized model (an EMA copy) runs equal to it,
bitwise, after the original's plan is removed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402
from tests.user_paths import BACKENDS, STYLES, GroupStyles, backward_runs, sum_over, use_backend  # noqa: E402

TOLERANCE = {"wan": 5e-9}
Batch = tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor]   # (args, kwargs, target); args[0] the input


def _wan(seed: int) -> tuple[torch.nn.Module, Batch]:
    from dsp_plugin.testing.tiny import tiny_wan

    g = torch.Generator().manual_seed(seed)
    batch = ((torch.randn(2, 4, 5, 4, 4, generator=g), torch.tensor([3, 700]), torch.randn(2, 7, 16, generator=g)),
             {"return_dict": False}, torch.randn(2, 4, 5, 4, 4, generator=g))
    return tiny_wan(layers=2, heads=3, head_dim=8), batch


def _latte(seed: int) -> tuple[torch.nn.Module, Batch]:
    from dsp_plugin.testing.tiny import tiny_latte

    g = torch.Generator().manual_seed(seed)
    batch = ((torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 700]), torch.randn(2, 7, 16, generator=g)),
             {"return_dict": False}, torch.randn(2, 8, 5, 6, 6, generator=g))
    return tiny_latte(frames=5, layers=2, heads=3, head_dim=4, sample_size=6), batch


def _svd(seed: int) -> tuple[torch.nn.Module, Batch]:
    from dsp_plugin.testing.tiny import tiny_spatiotemporal

    g = torch.Generator().manual_seed(seed)
    indicator = torch.zeros(2, 5)
    indicator[1] = 1.0
    batch = ((torch.randn(10, 32, 4, 4, generator=g),),
             {"encoder_hidden_states": torch.randn(10, 3, 16, generator=g), "image_only_indicator": indicator,
              "return_dict": False}, torch.randn(10, 32, 4, 4, generator=g))
    return tiny_spatiotemporal(layers=2), batch


def _cogvideox(seed: int) -> tuple[torch.nn.Module, Batch]:
    from tests.test_plan_joint import TEXT, _tiny_cogvideox

    g = torch.Generator().manual_seed(seed)
    batch = ((torch.randn(2, 5, 4, 6, 6, generator=g), torch.randn(2, TEXT, 16, generator=g), torch.tensor([3, 700])),
             {"return_dict": False}, torch.randn(2, 5, 4, 6, 6, generator=g))
    return _tiny_cogvideox(rope=False), batch


def _stdit(seed: int) -> tuple[torch.nn.Module, Batch]:
    from dsp_plugin.models.stdit import STDiT, STDiTConfig

    torch.manual_seed(0)
    model = STDiT(STDiTConfig.preset("tiny"))
    g = torch.Generator().manual_seed(seed)
    batch = ((torch.randn(2, 4, 5, 4, 4, generator=g), torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g)),
             {}, torch.randn(2, 4, 5, 4, 4, generator=g))
    return model, batch


MODELS: dict[str, Callable[[int], tuple[torch.nn.Module, Batch]]] = {
    "wan": _wan, "cogvideox": _cogvideox, "latte": _latte, "svd": _svd, "stdit": _stdit}


def run_model(model: torch.nn.Module, batch: Batch, *, backward: bool = True) -> tuple[Any, ...]:
    """(output, input gradient, parameter gradients) of one forward and backward of an MSE loss."""
    args, kwargs, target = batch
    x = args[0].clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        out = model(x, *args[1:], **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    if not backward:
        return (out,)
    torch.nn.functional.mse_loss(out, target).backward()
    return out.detach(), x.grad, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world_size: int, backend: str) -> dict[str, dict[str, float | str]]:
    import logging

    import dsp_plugin
    from dsp_plugin.plan.runtime import remove_plan

    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "Attention backends are an experimental feature"
    torch.set_default_dtype(torch.float64)
    grad = backward_runs(backend)
    styles = GroupStyles()
    references: dict[tuple[str, int], Any] = {}
    result: dict[str, dict[str, float | str]] = {}
    for name in STYLES:
        for model_name, build in MODELS.items():
            style = styles.enter(name)
            reference, batch = build(style.batch_seed)
            reference = reference.double()
            if not use_backend(reference, backend):
                continue
            key = (model_name, style.batch_seed)
            if key not in references:
                references[key] = run_model(copy.deepcopy(reference), batch, backward=grad)
            out_ref, *ref_grads = references[key]
            try:
                model = dsp_plugin.parallelize(copy.deepcopy(reference), group=style.group)
                out, *out_grads = run_model(model, batch, backward=grad)
                # an EMA copy: its hooks run on the copy's runtime, also once the original's plan is gone
                ema = copy.deepcopy(model)
                remove_plan(model)
                with torch.no_grad():
                    out_ema = run_model(ema, batch, backward=False)[0]
            except Exception as exc:  # noqa: BLE001 - reported per cell
                result[f"{name}/{model_name}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            cell = result[f"{name}/{model_name}"] = {
                "out": (out - out_ref).abs().max().item(), "ema_out": (out_ema - out.detach()).abs().max().item()}
            if grad:
                (dx_ref, grads_ref), (dx, grads) = ref_grads, out_grads
                grads = {k: sum_over(g, style.dsp_group) for k, g in grads.items()}
                cell.update(dx=(sum_over(dx, style.dsp_group) - dx_ref).abs().max().item(),
                            grads=max((grads[k] - g).abs().max().item() for k, g in grads_ref.items()),
                            missing=",".join(sorted(grads_ref.keys() ^ grads.keys())))
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_builtin_plan_every_group_style_equals_one_process(backend: str) -> None:
    results = run_distributed(_worker, 4, backend, timeout=900)
    assert all(results), "no cell ran"
    failures = []
    for rank, cells in enumerate(results):
        for cell, d in cells.items():
            print(f"rank {rank} {cell}: {d}")
            if "error" in d:
                failures.append(f"rank {rank} {cell}: {d['error']}")
                continue
            tolerance = TOLERANCE.get(cell.split("/")[1], 1e-9)
            if d.get("missing") or max(d["out"], d.get("dx", 0), d.get("grads", 0)) > tolerance or d["ema_out"]:
                failures.append(f"rank {rank} {cell}: {d}")
    assert not failures, "\n".join(failures)
