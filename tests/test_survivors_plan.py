"""The plan runtime on the ways users call a model that the model tests do not take.

Issue 29's survivors 1, 2 and 5, each against the unmodified model on one process (fp64):

- a diffusers model called with ``return_dict=True`` (diffusers' default): its output
  is a ``BaseOutput`` (a dict), whose tensors must get the replicated output's 1/N
  gradient like a tuple's (else every parameter's gradient is N times too large);
- a checkpointed block called twice in one forward (weights shared across depth):
  each call's recompute must replay its own head switch, or issue it again, never
  take the other call's output;
- GQA attention (fewer K/V heads than query heads, ``enable_gqa=True``) under the
  model's own non-reentrant checkpointing, evenly split (6 query / 2 K/V heads on
  2 ranks) and straddling K/V groups (9 / 3: rank 1's 4 query heads read K/V heads
  1, 2, 2, 2), with the backward all-to-alls counted against the same model
  without checkpointing: the head switches are replayed (2 of the 6 backward
  all-to-alls saved at 2 layers), since the local K/V repeat saves no tensor
  (an ``index_select`` there made the recompute save other tensors than its forward).

One spawn on 2 ranks (7 tokens: uneven).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("diffusers")

import dsp_plugin  # noqa: E402
from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.plan import Block, Gather, Heads, Split, recompute  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


class _GQAAttention(nn.Module):
    """``[B, L, D]`` self-attention with ``heads`` query and ``kv_heads`` K/V heads (SDPA's ``enable_gqa``)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q, self.kv = nn.Linear(dim, heads * head_dim), nn.Linear(dim, 2 * kv_heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)                        # [B, H, L, d]
        k, v = (t.unflatten(-1, (self.kv_heads, -1)).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(dim), _GQAAttention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class _Model(nn.Module):
    """``[B, L, C] -> [B, L, C]``; ``twice``: block 0 runs again after the others (shared weights);
    ``checkpointed``: each block call in its own non-reentrant checkpoint (the model's own, as diffusers')."""

    def __init__(self, heads: int, kv_heads: int, *, twice: bool, dim: int = 12, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3)
        self.twice, self.checkpointed = twice, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in [*self.blocks, self.blocks[0]] if self.twice else self.blocks:
            h = checkpoint(block.__call__, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.out(self.norm(h))


PLAN = {"embed": Split("out", "B L D", shard="L"), "blocks.*": Block("B L D", arg="x"), "blocks.*.attn": Heads(),
        "norm": Gather(0, "B L D")}
#: name -> (query heads, K/V heads, block 0 called twice)
MODELS = {"GQA 6/2": (6, 2, False), "GQA 9/3": (9, 3, False), "GQA 9/3, block 0 twice": (9, 3, True),
          "MHA 3/3, block 0 twice": (3, 3, True)}


def _step(model: nn.Module, x: torch.Tensor, parallel: bool) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    with CommAccounting(activations=False) as acct:
        out = model(x)
        out.square().mean().backward()
    grads, dx = [p.grad.clone() for p in model.parameters()], x.grad.clone()
    if parallel:
        reduce_gradients(model.parameters())
        grads = [p.grad.clone() for p in model.parameters()]
        dist.all_reduce(dx)
    return {"out": out.detach(), "dx": dx, "grads": grads, "bwd_a2a": acct.count("all_to_all", "backward"),
            "fwd_a2a": acct.count("all_to_all", "forward"), "kept": recompute.kept()}


def _models(rank: int, n: int) -> dict[str, dict[str, float]]:
    x = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # 7 tokens: uneven
    rows: dict[str, dict[str, float]] = {}
    for name, (heads, kv_heads, twice) in MODELS.items():
        reference = _Model(heads, kv_heads, twice=twice).double()
        ref = _step(copy.deepcopy(reference), x, parallel=False)
        for checkpointed in (False, True):
            model = copy.deepcopy(reference)
            model.checkpointed = checkpointed
            got = _step(dsp_plugin.parallelize(model, PLAN), x, parallel=True)
            rows[f"{name}{', checkpointed' if checkpointed else ''}"] = {
                "output": (got["out"] - ref["out"]).abs().max().item(),
                "input gradient": (got["dx"] - ref["dx"]).abs().max().item(),
                "parameter gradients": max((a - b).abs().max().item() for a, b in zip(got["grads"], ref["grads"])),
                "fwd_a2a": got["fwd_a2a"], "bwd_a2a": got["bwd_a2a"], "kept": got["kept"]}
    return rows


def _return_dict(rank: int, n: int) -> dict[str, float]:
    """Wan called with ``return_dict=True``: the parameter gradients summed over the group against one process."""
    from dsp_plugin.testing.tiny import tiny_wan

    g = torch.Generator().manual_seed(5)
    latents = torch.randn(2, 4, 3, 4, 4, generator=g, dtype=torch.float64)
    timestep, text = torch.tensor([3, 700]), torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    reference = tiny_wan(layers=1, heads=2, head_dim=8).double()
    grads = []
    for parallel in (False, True):
        model = copy.deepcopy(reference)
        if parallel:
            dsp_plugin.parallelize(model)
        out = model(latents, timestep, text)              # return_dict=True: a Transformer2DModelOutput
        out.sample.square().mean().backward()
        if parallel:
            reduce_gradients(model.parameters())
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    ref, got = grads
    return {"max |gradient - one process|": max((got[k] - ref[k]).abs().max().item() for k in ref),
            "gradient ratio (time embedding)": (got["condition_embedder.time_embedder.linear_1.weight"].norm()
                                                / ref["condition_embedder.time_embedder.linear_1.weight"].norm()
                                                ).item()}


def _two_ranks(rank: int, n: int) -> dict[str, Any]:
    return {"models": _models(rank, n), "return_dict": _return_dict(rank, n)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2)


def test_return_dict_true_gets_the_one_process_gradients(two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        d = result["return_dict"]
        assert d["max |gradient - one process|"] < 5e-9, (
            f"Wan called with return_dict=True (diffusers' default) on rank {rank} of 2: the parameter gradients "
            f"summed over the group are {d['gradient ratio (time embedding)']:.3g}x the one-process ones "
            f"(max |diff| {d['max |gradient - one process|']:.3g}); the BaseOutput's tensors must get the "
            f"replicated output's 1/N gradient like a tuple's")


def _check_models(results: list[dict[str, Any]], n: int) -> None:
    for rank, result in enumerate(results):
        rows = result["models"]
        for row, d in rows.items():
            print(f"n={n} rank {rank} {row}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
            for key in ("output", "input gradient", "parameter gradients"):
                assert d[key] < 1e-12, (f"{row} on rank {rank} of {n}: the {key} is {d[key]:.3g} off the model on "
                                        f"one process (fp64)")
            assert d["kept"] == 0, f"{row} on rank {rank} of {n}: {d['kept']} collective outputs kept after the step"
        for name, (heads, kv_heads, twice) in MODELS.items():
            plain, ckpt = rows[name], rows[f"{name}, checkpointed"]
            calls = 3 if twice else 2                     # attention calls per forward
            assert plain["fwd_a2a"] == plain["bwd_a2a"] == ckpt["fwd_a2a"] == 2 * calls, (name, rank, plain, ckpt)
            if not twice:  # each head switch replayed in the recompute, GQA too (a module called twice keeps none)
                assert ckpt["bwd_a2a"] == plain["bwd_a2a"], (
                    f"{name} under checkpointing on rank {rank} of {n}: {ckpt['bwd_a2a']} all-to-alls in backward, "
                    f"{plain['bwd_a2a']} without checkpointing; the recompute issued head switches again instead "
                    f"of replaying the forward's")


def test_gqa_and_a_block_called_twice_under_checkpointing_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    _check_models(two_ranks, 2)

