"""The adapters called the ways users call them (issue 25's matrix, adapters family).

One 4-rank spawn over the group styles of ``tests.user_paths``: ``LatteDSP`` and ``SpatioTemporalDSP``
(wrappers over the built-in plans) and a hand-written ``Sharded`` forward (a 3-axis toy, T x H x W),
each given ``group=`` as the style says. Oracle: the unmodified module on one process (fp64): output,
input gradient (the adapters' convention: ``LatteDSP`` and ``Sharded`` enter through ``split``, whose
backward hands every rank the full one; ``SpatioTemporalDSP`` is ``parallelize``: partial, summed here)
and parameter gradients summed over the DSP group.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402
from tests.user_paths import STYLES, GroupStyles, sum_over  # noqa: E402


def _latte(group: Any, seed: int) -> tuple[Any, Any, tuple[torch.Tensor, ...], dict[str, Any], bool]:
    from dsp_plugin.adapters import LatteDSP
    from dsp_plugin.testing.tiny import tiny_latte

    reference = tiny_latte(frames=5, layers=1, heads=3, head_dim=4, sample_size=6).double()
    g = torch.Generator().manual_seed(seed)
    args = (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 700]), torch.randn(2, 7, 16, generator=g))
    return reference, LatteDSP(copy.deepcopy(reference), group=group), args, {"return_dict": False}, True


def _svd(group: Any, seed: int) -> tuple[Any, Any, tuple[torch.Tensor, ...], dict[str, Any], bool]:
    from dsp_plugin.adapters import SpatioTemporalDSP
    from dsp_plugin.testing.tiny import tiny_spatiotemporal

    reference = tiny_spatiotemporal(layers=1).double()
    g = torch.Generator().manual_seed(seed)
    indicator = torch.zeros(2, 5)
    kwargs = {"encoder_hidden_states": torch.randn(10, 3, 16, generator=g), "image_only_indicator": indicator,
              "return_dict": False}
    return reference, SpatioTemporalDSP(copy.deepcopy(reference), group=group), \
        (torch.randn(10, 32, 4, 4, generator=g),), kwargs, False


class _Axial(torch.nn.Module):
    """Three per-axis mixers on ``[B, T, H, W, D]``; ``group`` set: the same forward through ``Sharded``."""

    def __init__(self, group: Any = None, sharded: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mixers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.group, self.sharded = group, sharded

    def mix(self, i: int, x: torch.Tensor) -> torch.Tensor:   # [rows, L, D]: softmax attention along L
        q = self.mixers[i](x)
        return x + torch.softmax(q @ x.transpose(1, 2), dim=-1) @ x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            for i, d in enumerate((1, 2, 3)):
                moved = x.movedim(d, -2)
                x = self.mix(i, moved.reshape(-1, *moved.shape[-2:])).reshape(moved.shape).movedim(-2, d)
            return x
        from dsp_plugin.adapters import Sharded

        seq = Sharded.enter(x, shard=1, group=self.group)
        for i, d in enumerate((1, 2, 3)):
            seq = seq.attend(d)
            seq = seq.unfold(self.mix(i, seq.fold(d)), d)
        return seq.leave()


def _sharded(group: Any, seed: int) -> tuple[Any, Any, tuple[torch.Tensor, ...], dict[str, Any], bool]:
    x = torch.randn(2, 5, 6, 7, 8, generator=torch.Generator().manual_seed(seed))
    return _Axial(), _Axial(group, sharded=True), (x,), {}, True


ADAPTERS = {"LatteDSP": _latte, "SpatioTemporalDSP": _svd, "Sharded": _sharded}


def _run(model: Any, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    x = args[0].clone().requires_grad_(True)
    out = model(x, *args[1:], **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.square().mean().backward()
    grads = {k.removeprefix("model."): p.grad for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    styles = GroupStyles()
    out: dict[str, Any] = {}
    for name in STYLES:
        for adapter, build in ADAPTERS.items():
            style = styles.enter(name)
            try:
                reference, wrapped, args, kwargs, full_dx = build(style.group, style.batch_seed)
                out_ref, dx_ref, g_ref = _run(reference, args, kwargs)
                result, dx, grads = _run(wrapped, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - reported per cell
                out[f"{name}/{adapter}"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            dx = dx if full_dx else sum_over(dx, style.dsp_group)
            grads = {k: sum_over(g, style.dsp_group) for k, g in grads.items()}
            out[f"{name}/{adapter}"] = {
                "out": (result - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item(),
                "grads": max((grads[k] - g).abs().max().item() for k, g in g_ref.items())}
    return out


def test_adapters_every_group_style_equal_one_process() -> None:
    failures = []
    for rank, cells in enumerate(run_distributed(_worker, 4, timeout=600)):
        for cell, d in cells.items():
            print(f"rank {rank} {cell}: {d}")
            if isinstance(d, str) or max(d.values()) > 1e-9:
                failures.append(f"rank {rank} {cell}: {d}")
    assert not failures, "\n".join(failures)
