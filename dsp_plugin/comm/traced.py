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
(partial_grad)  all_gather                           reduce_scatter of the gradient (sum, own chunk)
dynamic_switch  all_to_all_single_autograd           the reverse all-to-all (funcol's autograd)
(comm_dtype)    encode, all_to_all_single of bytes,  the reverse switch, in the gradient's format
                decode (``payload``)                 (``_TracedWireSwitch``)
==============  ===================================  ==========================================

Values are those of the eager path bit for bit (pure data movement, the same blocks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dsp_plugin.comm import collectives
from dsp_plugin.packing import chunk_sizes, offsets  # chunk_sizes traces on a symbolic length

__all__ = ["traced_gather", "traced_gather_partial", "traced_split", "traced_switch", "traced_wire_switch"]


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


def _reduce_scattered(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int,
                      rank: int) -> torch.Tensor:
    """Every rank's full-length ``x`` summed over the group, this rank's chunk of ``dim`` (no autograd): one
    reduce_scatter of equal blocks, uneven chunks padded (the blocks of ``reduce_scatter._reduce_scatter``)."""
    sizes = chunk_sizes(full, n)
    block = max(sizes)
    moved = x.movedim(dim, 0)
    parts = []
    for start, size in zip(offsets(sizes), sizes):
        part = moved.narrow(0, start, size)
        if size < block:
            part = torch.cat([part, part.new_zeros(block - size, *part.shape[1:])])
        parts.append(part)
    summed = collectives.traced_reduce_scatter(torch.cat(parts).contiguous(), group=group)  # [block, ..]
    return summed.narrow(0, 0, sizes[rank]).movedim(0, dim)


class _TracedGatherPartial(torch.autograd.Function):
    """All-gathered ``x``; backward: the gradient reduce-scattered (``gather(partial_grad=True)`` compiled)."""

    @staticmethod
    def forward(ctx, x, dim, full, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank = dim, full, group, n, rank
        return _gathered(x, dim, full, group, n)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scattered(grad, ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank), None, None, None, None, None


def traced_gather_partial(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int,
                          rank: int) -> torch.Tensor:
    """All-gathered ``x`` whose gradient is the sum over the group of the output's gradients, this rank's chunk."""
    return _TracedGatherPartial.apply(x, dim, full, group, n, rank)


class _TracedWireSwitch(torch.autograd.Function):
    """The switch with its blocks sent in a wire format (``payload``: FP8 and a scale per block) under compile:
    the eager ``_switch``'s encode, one functional all-to-all of the ``uint8`` bytes and its decode; backward:
    the reverse switch of the gradient in the payload's gradient format, as the eager ``_Switch``'s."""

    @staticmethod
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank, wire):  # type: ignore[override]
        ctx.cur, ctx.tgt, ctx.tgt_full, ctx.group, ctx.n, ctx.rank, ctx.wire = cur, tgt, x.shape[tgt], group, n, \
            rank, wire
        return _wire_switch(x, cur, tgt, cur_full, group, n, rank, wire.forward)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (_wire_switch(grad, ctx.tgt, ctx.cur, ctx.tgt_full, ctx.group, ctx.n, ctx.rank, ctx.wire.grad),
                None, None, None, None, None, None, None)


def _wire_switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int, rank: int,
                 fmt: torch.dtype) -> torch.Tensor:
    """S(cur) -> S(tgt), the blocks of ``traced_switch`` sent as ``payload.exchange`` sends them (no autograd)."""
    from dsp_plugin.comm import payload

    tgt_sizes, cur_sizes = chunk_sizes(x.shape[tgt], n), chunk_sizes(cur_full, n)
    rows = [[x.narrow(tgt, start, size).reshape(-1)] for start, size in zip(offsets(tgt_sizes), tgt_sizes)]
    block_shape = list(x.shape)
    block_shape[tgt] = tgt_sizes[rank]
    per_cur_row = math.prod([s for d, s in enumerate(block_shape) if d != cur])
    received = payload.exchange(rows, [[(per_cur_row * c,)] for c in cur_sizes], [fmt], group, rank)
    parts = []
    for row, c in zip(received, cur_sizes):
        shape = list(block_shape)
        shape[cur] = c
        parts.append(row[0].view(shape))
    return torch.cat(parts, dim=cur)


def traced_wire_switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int,
                       rank: int, wire: object) -> torch.Tensor:
    """``traced_switch`` with ``comm_dtype`` (a ``payload.Payload``): the eager FP8 switch's values bit for bit."""
    return _TracedWireSwitch.apply(x, cur, tgt, cur_full, group, n, rank, wire)


def traced_switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int,
                  rank: int) -> torch.Tensor:
    """S(cur) -> S(tgt) with one functional all-to-all; the blocks of ``primitives._switch``.

      send block j = x.narrow(tgt, t_j)         [.., c_rank, .., t_j, ..]  -> rank j
      recv block i                              [.., c_i, .., t_rank, ..]  from rank i
      out          = recv blocks concatenated along cur
    """
    tgt_sizes, cur_sizes = chunk_sizes(x.shape[tgt], n), chunk_sizes(cur_full, n)
    # each block a row [1, numel], joined along dim 1: a block of shape (0,) would be one of ``cat``'s legacy
    # empty inputs, whose gradient is a fresh zeros(0) cut off from the output's; on a rank whose blocks are
    # all empty the reverse all-to-all then feeds no gradient, AOTAutograd's partitioner leaves it out of the
    # backward graph, and that rank skips a collective its peers make (gloo: "Received data size doesn't
    # match expected size")
    blocks = [x.narrow(tgt, start, size).reshape(1, -1) for start, size in zip(offsets(tgt_sizes), tgt_sizes)]
    send = torch.cat(blocks, dim=1).reshape(-1)
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
