"""split, gather and dynamic_switch as torch.compile traces them: functional collectives, no host sync.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the public primitives
take this path instead of their autograd Functions around in-place c10d calls:
the same packing, the same blocks and the same adjoints, built from torch ops and
torch's functional collectives (``collectives.traced_*``), which dynamo records as
graph ops and AOTAutograd differentiates, so the compiled graph has no break and
no host sync (every length is a Python int known at trace time: the caller's
``global_len`` or the tag's, never asked of the group). The cross-rank check of
the eager path (``agree``) is not traced: it runs in eager calls, and a compiled
model's first eager call (or ``DSP_CHECK=1`` eager runs) checks the same calls.

==============  ===================================  ==========================================
primitive       forward                              backward (the project's adjoints)
==============  ===================================  ==========================================
split           this rank's chunk (no collective)    all_gather of the gradient chunks
gather          all_gather                           this rank's chunk (no collective)
dynamic_switch  all_to_all_single_autograd           the reverse all-to-all (funcol's autograd)
==============  ===================================  ==========================================

Values are those of the eager path bit for bit (pure data movement, the same blocks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dsp_plugin.comm import collectives
from dsp_plugin.packing import offsets

__all__ = ["traced_gather", "traced_split", "traced_switch"]


def chunk_sizes(length: int, parts: int) -> list[int]:
    """``packing.chunk_sizes`` without ``divmod`` (dynamo does not trace it on a symbolic length)."""
    base = length // parts
    extra = length - base * parts
    return [base + 1 if i < extra else base for i in range(parts)]


def _gathered(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """S(dim) -> R of ``x`` (no autograd): one all_gather of equal blocks, padding dropped."""
    sizes = chunk_sizes(full, n)
    block = max(sizes)
    moved = x.movedim(dim, 0)
    if moved.shape[0] < block:  # an uneven chunk: padded to the common block
        moved = torch.cat([moved, moved.new_zeros(block - moved.shape[0], *moved.shape[1:])])
    recv = collectives.traced_all_gather(moved.contiguous(), group=group)  # [n * block, ..]
    parts = [recv.narrow(0, i * block, size) for i, size in enumerate(sizes)]
    return torch.cat(parts).movedim(0, dim)


class _TracedSplit(torch.autograd.Function):
    """This rank's chunk; backward: the gradient chunks all-gathered (functional collective, traceable)."""

    @staticmethod
    def forward(ctx, x, dim, start, size, group, n):  # type: ignore[override]
        ctx.dim, ctx.full, ctx.group, ctx.n = dim, x.shape[dim], group, n
        return x.narrow(dim, start, size).clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gathered(grad, ctx.dim, ctx.full, ctx.group, ctx.n), None, None, None, None, None


def traced_split(x: torch.Tensor, dim: int, group: dist.ProcessGroup, n: int, rank: int) -> torch.Tensor:
    sizes = chunk_sizes(x.shape[dim], n)
    return _TracedSplit.apply(x, dim, offsets(sizes)[rank], sizes[rank], group, n)


def traced_gather(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int,
                  rank: int) -> torch.Tensor:
    """All-gathered ``x`` whose gradient is this rank's chunk of the output's gradient (no collective)."""
    whole = _gathered(x.detach(), dim, full, group, n)
    sizes = chunk_sizes(full, n)
    start = offsets(sizes)[rank]
    # the same values, with this rank's own (live) chunk in place: the gradient flows to x from it alone
    return torch.cat([whole.narrow(dim, 0, start), x, whole.narrow(dim, start + sizes[rank],
                                                                   full - start - sizes[rank])], dim=dim)


def traced_switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int,
                  rank: int) -> torch.Tensor:
    """S(cur) -> S(tgt) with one functional all-to-all; the blocks of ``primitives._switch``.

      send block j = x.narrow(tgt, t_j)         [.., c_rank, .., t_j, ..]  -> rank j
      recv block i                              [.., c_i, .., t_rank, ..]  from rank i
      out          = recv blocks concatenated along cur
    """
    tgt_sizes, cur_sizes = chunk_sizes(x.shape[tgt], n), chunk_sizes(cur_full, n)
    blocks = [x.narrow(tgt, start, size).reshape(-1) for start, size in zip(offsets(tgt_sizes), tgt_sizes)]
    send = torch.cat(blocks)
    block_shape = list(x.shape)
    block_shape[tgt] = tgt_sizes[rank]
    per_cur_row = math.prod([s for d, s in enumerate(block_shape) if d != cur])  # a list: dynamo traces it
    recv_splits = [per_cur_row * c for c in cur_sizes]
    recv = collectives.traced_all_to_all(send, send_splits=[b.numel() for b in blocks], recv_splits=recv_splits,
                                         group=group)
    parts = []
    for part, c in zip(recv.split(recv_splits), cur_sizes):
        shape = list(block_shape)
        shape[cur] = c
        parts.append(part.view(shape))
    return torch.cat(parts, dim=cur)
