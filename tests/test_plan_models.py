"""``dsp_plugin.parallelize`` on diffusers' Wan (full 3D, head switch) and Latte (factorized, folded rows).

Oracle: the unmodified diffusers model on one process, in fp64, on the same
weights and batch. 3 heads and 45 tokens (5 frames x 3x3 patches) on 2 and 4
ranks: uneven frames, uneven patches, and on 4 ranks one rank holds no head.
Output, input gradient and every parameter gradient summed over the group
(the project's convention) within 1e-9; the forward's collectives counted.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

import dsp_plugin  # noqa: E402
from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.testing.tiny import tiny_latte, tiny_wan  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LAYERS = 2
# Wan's own blocks compute the adaLN modulation in fp32 (``temb.float()``, ``norm1(hidden_states.float())``) even
# in an fp64 model, so the gradients of the parameters before it (the time embedder, ~0.04) carry fp32
# rounding of the summation order: measured up to 1.3e-9 absolute (3e-8 relative). Everything else is fp64.
TOLERANCE = {"latte": {"out": 1e-9, "dx": 1e-9, "grads": 1e-9}, "wan": {"out": 1e-9, "dx": 1e-9, "grads": 5e-9}}


def _batch(model: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    channels = (4, 8) if model == "latte" else (4, 4)
    latents = torch.randn(2, channels[0], 5, 6, 6, generator=g, dtype=torch.float64)
    timestep = torch.tensor([3, 700])
    text = torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    target = torch.randn(2, channels[1], 5, 6, 6, generator=g, dtype=torch.float64)
    return latents, timestep, text, target


def _build(model: str) -> torch.nn.Module:
    if model == "latte":
        return tiny_latte(frames=5, layers=LAYERS, heads=3, head_dim=4, sample_size=6).double()
    return tiny_wan(layers=LAYERS, heads=3, head_dim=8).double()


def _run(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], ckpt: bool = False) -> tuple[torch.Tensor, ...]:
    latents, timestep, text, target = batch
    latents = latents.clone().requires_grad_(True)
    with CommAccounting(activations=False) as acct:
        out = model(latents, timestep, text, return_dict=False)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), latents.grad, grads, acct


def _parallel(rank: int, n: int, name: str) -> dict[str, float]:
    reference = _build(name)
    batch = _batch(name)
    out_ref, dx_ref, g_ref, _ = _run(reference, batch)
    result: dict[str, float] = {}
    for ckpt in (False, True):
        model = copy.deepcopy(reference)
        if ckpt:
            model.enable_gradient_checkpointing()
        parallel = dsp_plugin.parallelize(model)
        assert parallel is model
        out, dx, _, acct = _run(parallel, batch)
        reduce_gradients(model.parameters())
        dist.all_reduce(dx)
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == g_ref.keys(), sorted(set(grads) ^ set(g_ref))
        tag = "ckpt_" if ckpt else ""
        result |= {f"{tag}out": (out - out_ref).abs().max().item(), f"{tag}dx": (dx - dx_ref).abs().max().item(),
                   f"{tag}grads": max((grads[k] - g_ref[k]).abs().max().item() for k in grads)}
        if not ckpt:
            result |= {"fwd_all_to_all": acct.count("all_to_all", "forward"),
                       "fwd_all_gather": acct.count("all_gather", "forward"),
                       "fwd_collectives": acct.count(phase="forward")}
    return result


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", ["wan", "latte"])
def test_parallelize_equals_unmodified_model(name: str, n: int) -> None:
    for rank, d in enumerate(run_distributed(_parallel, n, name)):
        print(f"{name} n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
        for key in ("out", "dx", "grads", "ckpt_out", "ckpt_dx", "ckpt_grads"):
            assert d[key] < TOLERANCE[name][key.removeprefix("ckpt_")], f"{name} rank {rank}/{n}: {key} {d[key]:.3g}"
        # per layer: Wan one head switch there and one back (self-attention only; cross-attention local),
        # Latte one switch after each of its two blocks; the exit is one all_gather, the entry none
        assert d["fwd_all_to_all"] == 2 * LAYERS, d
        assert d["fwd_all_gather"] == 1, d
