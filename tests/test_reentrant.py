"""Lengths travel with the data: double backward, activation checkpointing, two forwards in flight,
threads and keyword arguments, each against the single process.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsp_plugin import dynamic_switch, gather, parallelize, reduce_gradients, split
from dsp_plugin.models import STDiT, STDiTConfig
from dsp_plugin.plan.builtin import stdit_plan
from tests.distributed import run_distributed

TOL = 1e-5


# --------------------------------------------------------------------------- double backward


def _penalty(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dsp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient penalty: ||d f / d x||^2 through split, switch and gather; returns (penalty, grad_x)."""
    x = x.clone().requires_grad_(True)
    h = split(x, 1) if dsp else x                          # [B, T, S, D] -> S(1)
    h = torch.tanh(h @ w1)
    if dsp:
        h = dynamic_switch(h, 1, 2)                        # S(1) -> S(2)
    y = torch.tanh(h @ w2) ** 2
    if dsp:
        y = gather(y, 2)                                   # S(2) -> R: one more collective on the path
    (grad_x,) = torch.autograd.grad(y.sum(), x, create_graph=True)   # full on every rank
    return (grad_x ** 2).sum(), grad_x.detach()


def _double_backward(rank: int, n: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    # float64, so a wrong or dropped second-order term cannot hide in rounding
    x = torch.randn(2, 7, 5, 4, generator=g, dtype=torch.float64)    # uneven T and S
    w = [torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2)]
    w_ref = [p.detach().clone().requires_grad_(True) for p in w]
    pen, gx = _penalty(x, *w, dsp=True)
    pen.backward()
    reduce_gradients(w)                                    # sum over the DSP group
    pen_ref, gx_ref = _penalty(x, *w_ref, dsp=False)
    pen_ref.backward()
    return {"penalty": abs(pen.item() - pen_ref.item()), "grad_x": (gx - gx_ref).abs().max().item(),
            "w1": (w[0].grad - w_ref[0].grad).abs().max().item(),
            "w2": (w[1].grad - w_ref[1].grad).abs().max().item(), "norm": w_ref[0].grad.norm().item()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_penalty_matches_single_process(spawned: Callable[[int, str], list[Any]], world_size: int) -> None:
    for d in spawned(world_size, "double_backward"):
        assert d["norm"] > 0.1
        for key in ("penalty", "grad_x", "w1", "w2"):
            assert d[key] < 1e-9, (key, d)


# --------------------------------------------------------------------------- the STDiT plan


class _Checkpointed(nn.Module):
    """Runs its block under torch's activation checkpointing; DSP hooks sit on the inner block."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return checkpoint(self.block, x, c, y, use_reentrant=self.reentrant)


class _KeywordSTDiT(STDiT):
    """Calls its blocks with keyword arguments only (``block(x=..., c=..., y=...)``)."""

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor | None = None):
        height, width = latents.shape[-2:]
        x, c = self.embedder(latents), self.t_embedder(timestep)
        y = self.text_proj(text) if self.text_proj is not None and text is not None else None
        for block in self.blocks:
            x = block(x=x, c=c, y=y)
        return self.unpatchify(self.final_layer(x, c), height, width)


def _variant(reference: STDiT, how: str) -> tuple[nn.Module, dict | None]:
    if how == "keywords":
        model = _KeywordSTDiT(reference.config)
        model.load_state_dict(reference.state_dict())
        return model, None
    model = copy.deepcopy(reference)
    if how == "plain":
        return model, None
    model.blocks = nn.ModuleList(_Checkpointed(b, reentrant=(how == "reentrant")) for b in model.blocks)
    # the block's hooks on the checkpointed module inside the wrapper
    plan = {(f"{k}.block" if k.startswith("blocks.") else k): v for k, v in stdit_plan(reference).items()}
    return model, plan


def _batch(frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, frames, 6, 4, generator=g), torch.randint(0, 1000, (1,), generator=g),
            torch.randn(1, 3, 16, generator=g), torch.randn(1, 4, frames, 6, 4, generator=g))


def _two_forwards_in_flight(rank: int, n: int, how: str) -> dict[str, float]:
    """Forward T=7, then T=5, then both backwards: each switch must use its own forward's lengths."""
    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny"))
    model, plan = _variant(reference, how)
    parallelize(model, plan)
    losses = []
    for net in (reference, model):
        total = 0.0
        for frames, seed in ((7, 1), (5, 2)):
            latents, t, text, target = _batch(frames, seed)
            loss = torch.nn.functional.mse_loss(net(latents, t, text), target)
            total = total + loss
        losses.append(total)
    losses[0].backward()
    losses[1].backward()
    reduce_gradients(model.parameters())
    grads = [(p.grad - q.grad).abs().max().item() for p, q in zip(reference.parameters(), model.parameters())]
    return {"loss": abs(losses[0].item() - losses[1].item()), "grad": max(grads)}


HOWS = ["plain", "keywords", "non_reentrant", "reentrant"]


@pytest.mark.parametrize("how", HOWS)
def test_two_lengths_in_flight(spawned: Callable[[int, str], list[Any]], how: str) -> None:
    for d in spawned(2, f"in_flight {how}"):
        assert d["loss"] < TOL and d["grad"] < TOL, (how, d)


# --------------------------------------------------------------------------- threads


def _threads(rank: int, n: int) -> list[bool]:
    """Two threads, each on its own group, switching tensors of different lengths at the same time."""
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    results = [False, False]
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        full = torch.arange(float(2 * (7 + 2 * i) * 6)).view(2, 7 + 2 * i, 6)   # T = 7 and 9
        barrier.wait()
        for _ in range(5):
            out = gather(dynamic_switch(split(full, 1, group=groups[i]), 1, 2, group=groups[i]), 2,
                         group=groups[i])
            results[i] = torch.equal(out, full)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_threads_keep_their_own_lengths(spawned: Callable[[int, str], list[Any]]) -> None:
    assert spawned(2, "threads") == [[True, True], [True, True]]


# --------------------------------------------------------------------------- overlap


def _overlap(rank: int, n: int, chunks: int) -> list[bool]:
    from dsp_plugin.comm import switch_apply

    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, 5, 4, generator=g, dtype=torch.float64)        # B=3, uneven T and S
    lin = nn.Linear(4, 4).double()
    grads = []
    outs = []
    for overlapped in (False, True):
        x = full.tensor_split(n, 1)[rank].clone().requires_grad_(True)
        lin.zero_grad()
        y = (switch_apply(x, lin, 1, 2, chunks=chunks, global_len=7) if overlapped
             else lin(dynamic_switch(x, 1, 2, global_len=7)))
        (y ** 2).sum().backward()
        outs.append(y.detach())
        grads.append((x.grad, lin.weight.grad.clone()))
    return [torch.equal(outs[0], outs[1]), torch.allclose(grads[0][0], grads[1][0], atol=1e-12),
            torch.allclose(grads[0][1], grads[1][1], atol=1e-12)]


CHUNKS = [2, 3]


@pytest.mark.parametrize("chunks", CHUNKS)
def test_overlapped_switch_equals_switch_then_fn(spawned: Callable[[int, str], list[Any]], chunks: int) -> None:
    for res in spawned(2, f"overlap {chunks}"):
        assert res == [True, True, True]


# --------------------------------------------------------------------------- one spawn per world size


def _spawn(rank: int, n: int) -> dict[str, Any]:
    """Every case of this file for world size ``n``, in turn on the same processes (starting them dominates)."""
    out: dict[str, Any] = {"double_backward": _double_backward(rank, n)}
    if n == 2:
        for how in HOWS:
            out[f"in_flight {how}"] = _two_forwards_in_flight(rank, n, how)
        out["threads"] = _threads(rank, n)
        for chunks in CHUNKS:
            out[f"overlap {chunks}"] = _overlap(rank, n, chunks)
    return out


@pytest.fixture(scope="module")
def spawned() -> Callable[[int, str], list[Any]]:
    """``spawned(n, case)``: that case's result on each rank, from one spawn per world size."""
    runs: dict[int, list[dict[str, Any]]] = {}

    def get(n: int, case: str) -> list[Any]:
        if n not in runs:
            runs[n] = run_distributed(_spawn, n)
        return [result[case] for result in runs[n]]

    return get
