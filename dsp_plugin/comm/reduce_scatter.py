"""The all_gather and its exact adjoint, the reduce_scatter: the data movement of ``gather`` (both backwards).

``_gather`` is S(dim) -> R (one all_gather); ``_reduce_scatter`` is its adjoint, every rank's
full-length tensor summed over the group and cut to this rank's chunk (one reduce_scatter).
Both send equal blocks, an uneven chunk padded to the largest inside, so gloo and NCCL take
them as ``all_gather_single`` / ``reduce_scatter_single``, and the bytes each rank sends are
the same both ways: ``(N - 1)`` blocks of the largest chunk.

``_GatherPartial`` and ``_ReduceScatter`` are each other's backward, so
``gather(partial_grad=True)`` is differentiable twice (a gradient penalty through a gathered
pair bias). The collectives go through ``dsp_plugin.comm.collectives``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsp_plugin.comm.collectives import _all_gather_tensor, _reduce_scatter_tensor
from dsp_plugin.packing import chunk_sizes, join_blocks, offsets, split_blocks

__all__: list[str] = []


def _gather(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """S(dim) -> R with one all_gather of equal-size blocks (uneven chunks padded inside)."""
    sizes = chunk_sizes(full, n)
    block = max(sizes)
    padded_shape = list(x.shape)
    padded_shape[dim] = block
    if x.shape[dim] == block:
        send = x.contiguous()
    else:
        send = x.new_zeros(padded_shape)
        send.narrow(dim, 0, x.shape[dim]).copy_(x)
    # gloo wants the output as blocks concatenated along dim 0: (n * p0, p1, ..)
    recv = x.new_empty((n * padded_shape[0], *padded_shape[1:]))
    _all_gather_tensor(recv, send, group)
    if block * n == full:
        return join_blocks(recv.view(-1), padded_shape, dim, sizes)
    # drop each block's padding: (n, .., block, ..) -> (.., full, ..)
    recv = recv.view(n, *padded_shape)
    out_shape = list(x.shape)
    out_shape[dim] = full
    out = x.new_empty(out_shape)
    for i, (start, size) in enumerate(zip(offsets(sizes), sizes)):
        out.narrow(dim, start, size).copy_(recv[i].narrow(dim, 0, size))
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, n: int, rank: int) -> torch.Tensor:
    """Every rank's full-length ``x`` summed over the group, this rank's chunk of dim ``dim``: one reduce_scatter
    of equal blocks (uneven chunks padded inside), the adjoint of ``_gather``.

      in    [.., L, ..] on every rank (its own values)
      send  block i = in.narrow(dim, chunk i), padded to the largest chunk   -> [n, .., block, ..]
      out   [.., c_rank, ..] = sum over ranks of block rank, padding dropped
    """
    sizes = chunk_sizes(x.shape[dim], n)
    block = max(sizes)
    block_shape = list(x.shape)
    block_shape[dim] = block
    if block * n == x.shape[dim]:
        send, _ = split_blocks(x, dim, n)  # n equal blocks in order, flat
    else:
        padded = x.new_zeros((n, *block_shape))
        for i, (start, size) in enumerate(zip(offsets(sizes), sizes)):
            padded[i].narrow(dim, 0, size).copy_(x.narrow(dim, start, size))
        send = padded.view(-1)
    out = x.new_empty(block_shape)
    _reduce_scatter_tensor(out.view(-1), send, group)
    if sizes[rank] == block:
        return out
    return out.narrow(dim, 0, sizes[rank]).clone(memory_format=torch.contiguous_format)



class _GatherPartial(torch.autograd.Function):
    """``gather(partial_grad=True)``: the all_gather; backward reduce-scatters (each rank's gradient is partial)."""

    @staticmethod
    def forward(ctx, x, dim, full, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank = dim, full, group, n, rank
        return _gather(x, dim, full, group, n)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = _ReduceScatter.apply(grad, ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank)
        return grad, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """The sum over the group, this rank's chunk; backward all-gathers (the adjoint)."""

    @staticmethod
    def forward(ctx, x, dim, full, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank = dim, full, group, n, rank
        return _reduce_scatter(x, dim, group, n, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = _GatherPartial.apply(grad, ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank)
        return grad, None, None, None, None, None
