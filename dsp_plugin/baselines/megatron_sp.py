"""Megatron-SP (Korthikanti et al., 2022) on the reference model: tensor parallel + sequence shards.

Between blocks the activation is sharded on T over the tensor-parallel group,
like the other baselines. Inside EVERY block (spatial and temporal) the
attention and the MLP each run Megatron's pattern:

    x [.., T/N, ..]  --all-gather-->  x [.., T, ..]                  (full sequence)
    column-parallel in (H/N heads | hidden/N)  ->  row-parallel out  (partial sums)
    --reduce-scatter-->  [.., T/N, ..]  + bias                       (sum, back to the shard)

4 collectives per block, 8 per layer, M (N-1)/N bytes each per device: the 8M
of paper Table 3. Norms, adaLN and cross-attention stay on the sequence shard
with replicated weights, as Megatron keeps LayerNorm in the sequence-parallel
region. The weights of the reference model are sliced at wrap time: rank r
holds heads ``[r H/N, (r+1) H/N)`` of q/kv/proj and rows/columns
``[r F/N, (r+1) F/N)`` of the MLP. Each sliced parameter carries
``tensor_model_parallel = True`` and ``tp_slice(full) -> local`` (used by the
tests); the other parameters hold partial gradients, summed over the group by
``reduce_replicated_gradients`` (Megatron all-reduces sequence-parallel norm
weights over TP the same way).
"""

from __future__ import annotations

from typing import Any

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsp_plugin.baselines.comm import all_gather_along, all_reduce_sum, reduce_scatter_along
from dsp_plugin.baselines.common import (
    TIME_DIM,
    check_heads,
    refuse_rope_and_masks,
    resolve_group,
    shard_on_time,
)

__all__ = ["parallelize_megatron_sp", "reduce_replicated_gradients"]


def _sliced(full: torch.Tensor, take: Callable[[torch.Tensor], torch.Tensor]) -> nn.Parameter:
    """A tensor-parallel parameter: this rank's slice of ``full``, tagged as Megatron tags its own."""
    param = nn.Parameter(take(full.detach()).clone())
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.tp_slice = take  # type: ignore[attr-defined]
    return param


def _replicated(full: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(full.detach().clone())


class TPAttention(nn.Module):
    """Self-attention with H/N heads per rank between an all-gather and a reduce-scatter.

    ``gather_dim`` is the dim of the attention input ``[rows, L, D]`` that holds
    this rank's T chunk: 1 in a temporal block (rows = B*S, L = T/N), 0 in a
    spatial block (rows = B*T/N, L = S). Rows are independent, so gathering them
    and scattering them back in the same order is exact.
    """

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, gather_dim: int) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        dim, heads = attn.q.in_features, attn.heads
        self.local_heads, self.head_dim = heads // n, dim // heads
        self.group, self.gather_dim = group, gather_dim
        width = self.local_heads * self.head_dim
        lo, hi = r * width, (r + 1) * width

        def rows(t: torch.Tensor) -> torch.Tensor:          # q: output rows of the local heads
            return t[lo:hi]

        def kv_rows(t: torch.Tensor) -> torch.Tensor:       # kv rows are laid out (2, H, d)
            return t.view(2, dim, *t.shape[1:])[:, lo:hi].reshape(2 * width, *t.shape[1:])

        self.q = nn.Linear(dim, width)
        self.q.weight, self.q.bias = _sliced(attn.q.weight, rows), _sliced(attn.q.bias, rows)
        self.kv = nn.Linear(dim, 2 * width)
        self.kv.weight, self.kv.bias = _sliced(attn.kv.weight, kv_rows), _sliced(attn.kv.bias, kv_rows)
        self.proj = nn.Linear(width, dim)
        self.proj.weight = _sliced(attn.proj.weight, lambda t: t[:, lo:hi])
        self.proj.bias = _replicated(attn.proj.bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: Any = None,
                key_mask: Any = None) -> torch.Tensor:
        refuse_rope_and_masks(type(self).__name__, angles, key_mask)
        if context is not None:
            raise ValueError("TPAttention replaces self-attention only; got a context")
        full = all_gather_along(x, self.gather_dim, group=self.group)       # [rows', L', D], whole sequence
        rows, length, _ = full.shape
        q = self.q(full).view(rows, length, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(full).view(rows, length, 2, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)                        # [rows', H/N, L', d]
        out = out.transpose(1, 2).reshape(rows, length, -1)                  # [rows', L', H/N * d]
        partial = F.linear(out, self.proj.weight)                            # sums over heads pending
        return reduce_scatter_along(partial, self.gather_dim, group=self.group) + self.proj.bias


class TPMLP(nn.Module):
    """``Linear -> GELU -> Linear`` with hidden/N columns per rank, on a T-sharded ``[B, T/N, S, D]``."""

    def __init__(self, mlp: nn.Sequential, group: dist.ProcessGroup) -> None:
        super().__init__()
        fc1, act, fc2 = mlp[0], mlp[1], mlp[2]
        n, r = dist.get_world_size(group), dist.get_rank(group)
        hidden = fc1.out_features
        if hidden % n:
            raise ValueError(f"megatron_sp: MLP hidden size {hidden} is not divisible by N={n}")
        lo, hi = r * hidden // n, (r + 1) * hidden // n
        self.group = group
        local_fc1 = nn.Linear(fc1.in_features, hi - lo)
        local_fc1.weight = _sliced(fc1.weight, lambda t: t[lo:hi])
        local_fc1.bias = _sliced(fc1.bias, lambda t: t[lo:hi])
        local_fc2 = nn.Linear(hi - lo, fc2.out_features)
        local_fc2.weight = _sliced(fc2.weight, lambda t: t[:, lo:hi])
        local_fc2.bias = _replicated(fc2.bias)
        # same child names as the nn.Sequential it replaces: parameter names do not change
        self.add_module("0", local_fc1)
        self.add_module("1", act)
        self.add_module("2", local_fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, act, fc2 = self._modules["0"], self._modules["1"], self._modules["2"]
        full = all_gather_along(x, TIME_DIM, group=self.group)              # [B, T, S, D]
        partial = F.linear(act(fc1(full)), fc2.weight)                       # [B, T, S, D], partial sums
        return reduce_scatter_along(partial, TIME_DIM, group=self.group) + fc2.bias


def parallelize_megatron_sp(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` (an STDiT) on T and make every block's attention and MLP tensor-parallel, in place."""
    group = resolve_group(group)
    n = dist.get_world_size(group)
    check_heads("megatron_sp", model.config.num_heads, n)
    state = shard_on_time(model, group=group, method="megatron_sp", require_even=True)
    for block in model.blocks:
        # the attention input is [B*rest, L_attend, D]: T is dim 1 if the block attends T, else in the rows
        block.attn = TPAttention(block.attn, group, gather_dim=1 if block.attend_dim == TIME_DIM else 0)
        block.mlp = TPMLP(block.mlp, group)
    model.sequence_state = state
    model.tp_group = group
    return model


def reduce_replicated_gradients(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Sum the partial gradients of the replicated (non tensor-parallel) parameters over ``group``."""
    group = resolve_group(group)
    grads = [p.grad for p in model.parameters()
             if p.grad is not None and not getattr(p, "tensor_model_parallel", False)]
    all_reduce_sum(grads, group=group)
