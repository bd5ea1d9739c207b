"""Ring attention: K/V travel around the ring, softmax merged online (Liu et al., 2023).

Used in the blocks whose attention dim is the sharded one: paper appendix A.2,
"we implement sequence communication in the temporal transformer as the time
axis is split"; spatial blocks run locally. No head limit, and uneven T is
fine. Each rank keeps its queries and sees every K/V chunk once, so a
forward sends N-1 hops of (K, V): 2 M (N-1)/N bytes per layer and device, the
~2M of paper Table 3.

Forward per rank (``lse`` = log-sum-exp of the scores seen so far):

    out, lse = 0, -inf
    for step in 0..N-1:          # K/V chunk from rank (r - step) mod N
        s = q k^T * scale
        out, lse = merge((out, lse), (softmax(s) v, logsumexp(s)))
        k, v = ring_shift([k, v])  # one batched send/recv; not after the last step

Backward recomputes each chunk's probabilities from the saved ``lse`` (no
N x N score matrix is kept) and sends dK/dV around the ring with their K/V
until they are home (ring-flash-attention's scheme). Uneven chunk lengths
(``torch.tensor_split``) are supported: no block attends across padding
because there is none.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin.baselines.common import (
    ShardState,
    refuse_rope_and_masks,
    resolve_group,
    shard_on_time,
    sharded_blocks,
)
from dsp_plugin.baselines.comm import ring_shift

__all__ = ["RingSelfAttention", "parallelize_ring", "ring_attention"]


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    # q [B, Lq, H, d], k [B, Lk, H, d] -> s [B, H, Lq, Lk]
    return torch.einsum("bqhd,bkhd->bhqk", q, k) * scale


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        b, lq, h, d = q.shape
        out = q.new_zeros(b, h, lq, d)
        lse = q.new_full((b, h, lq, 1), -math.inf)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(n):
            s = _block_scores(q, k_cur, scale)                       # [B, H, Lq, Lk]
            block_lse = torch.logsumexp(s, dim=-1, keepdim=True)     # [B, H, Lq, 1]
            block_out = torch.einsum("bhqk,bkhd->bhqd", torch.exp(s - block_lse), v_cur)
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse)
            lse = new_lse
            if step < n - 1:
                # the chunk arriving next started at rank (r - step - 1) mod n
                src_len = lengths[(rank - step - 1) % n]
                k_cur, v_cur = ring_shift([k_cur, v_cur], (b, src_len, h, d), group=group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lengths, ctx.group, ctx.scale = lengths, group, scale
        # [B, H, Lq, d] -> [B, Lq, H, d]
        return out.permute(0, 2, 1, 3).contiguous()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, lengths, scale = ctx.group, ctx.lengths, ctx.scale
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        b, lq, h, d = q.shape
        dout = grad_out.permute(0, 2, 1, 3)                          # [B, H, Lq, d]
        delta = (dout * out).sum(dim=-1, keepdim=True)               # [B, H, Lq, 1]
        dq = torch.zeros_like(q)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        dk_cur, dv_cur = torch.zeros_like(k_cur), torch.zeros_like(v_cur)
        for step in range(n):
            p = torch.exp(_block_scores(q, k_cur, scale) - lse)      # [B, H, Lq, Lk]
            dv_cur = dv_cur + torch.einsum("bhqk,bhqd->bkhd", p, dout)
            dp = torch.einsum("bhqd,bkhd->bhqk", dout, v_cur)
            ds = p * (dp - delta) * scale
            dq = dq + torch.einsum("bhqk,bkhd->bqhd", ds, k_cur)
            dk_cur = dk_cur + torch.einsum("bhqk,bqhd->bkhd", ds, q)
            # dK/dV travel with their K/V; after n shifts they are back at their owner
            src_len = lengths[(rank - step - 1) % n]
            if step < n - 1:
                k_cur, v_cur, dk_cur, dv_cur = ring_shift([k_cur, v_cur, dk_cur, dv_cur], (b, src_len, h, d),
                                                          group=group)
            else:
                dk_cur, dv_cur = ring_shift([dk_cur, dv_cur], (b, src_len, h, d), group=group)
        return dq, dk_cur, dv_cur, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lengths: list[int],
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Softmax attention of local queries over the keys of every rank; ``[B, L_local, H, d]`` in and out.

    ``lengths`` is every rank's sequence chunk length (rank order). A size-1
    group falls back to one local chunk.
    """
    if dist.get_world_size(group) == 1:
        s = _block_scores(q, k, 1.0 / math.sqrt(q.shape[-1]))
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    if k.shape[1] != lengths[dist.get_rank(group)]:
        raise ValueError(f"ring_attention: rank {dist.get_rank(group)} holds {k.shape[1]} keys, "
                         f"expected {lengths[dist.get_rank(group)]} from lengths={lengths}")
    return _RingAttention.apply(q, k, v, list(lengths), group)


class RingSelfAttention(nn.Module):
    """Self-attention of a temporal block over a T-sharded input ``[rows, T_rank, D]``."""

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, state: ShardState) -> None:
        super().__init__()
        self.heads = attn.heads
        self.q, self.kv, self.proj = attn.q, attn.kv, attn.proj
        self.group, self.state = group, state

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: Any = None,
                key_mask: Any = None) -> torch.Tensor:
        refuse_rope_and_masks(type(self).__name__, angles, key_mask)
        if context is not None:
            raise ValueError("RingSelfAttention replaces self-attention only; got a context")
        rows, length, dim = x.shape
        q = self.q(x).view(rows, length, self.heads, -1)                         # [rows, T_r, H, d]
        k, v = (t.contiguous() for t in self.kv(x).view(rows, length, 2, self.heads, -1).unbind(dim=2))
        out = ring_attention(q, k, v, lengths=self.state.lengths, group=self.group)
        return self.proj(out.reshape(rows, length, dim))


def parallelize_ring(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` (an STDiT) on T and put ring attention in its temporal blocks, in place."""
    group = resolve_group(group)
    state = shard_on_time(model, group=group, method="ring", require_even=False)
    for block in sharded_blocks(model):
        block.attn = RingSelfAttention(block.attn, group, state)
    model.sequence_state = state
    return model
