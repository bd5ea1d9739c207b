"""The collectives the baselines issue themselves (DeepSpeed-Ulysses brings its own).

Besides ``dsp_plugin.comm``, this is the only module allowed to call
torch.distributed collectives, so the baselines' traffic is as easy to audit
as DSP's. The shapes follow Megatron-LM's sequence-parallel mappings
(``megatron/core/tensor_parallel/mappings.py``): an all-gather whose backward
is a reduce-scatter and the reverse. Megatron's own functions cannot be reused
here: they allocate on ``torch.cuda.current_device()`` and bind
``all_gather_into_tensor`` at import.

``paper_all_to_all`` is the all-to-all of the paper's harness (OpenDiT
``opendit/core/comm.py`` ``_all_to_all_func``): ``tensor_split`` along the
scatter dim, each chunk made contiguous (copy 1), exchanged, and the received
chunks ``torch.cat`` along the gather dim (copy 2). The harness calls the list
form ``dist.all_to_all``, which gloo lacks, so here the contiguous chunks are
written into one send buffer (still one copy of the input) for
``all_to_all_single``: the same bytes and the same two copies.

The ring hop for ring attention uses point-to-point send/recv through
``batch_isend_irecv`` (what ring-flash-attention does); gloo runs it on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_along", "all_reduce_sum", "bare_all_to_all", "paper_all_to_all", "reduce_scatter_along",
           "ring_shift"]


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal chunks along ``dim`` -> the whole tensor (one all_gather_into_tensor)."""
    n = dist.get_world_size(group)
    # [.., L/n, ..] -> [L/n, ..] (dim moved first, contiguous: gloo rejects strided inputs)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    # [L, ..] -> [.., L, ..]
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Whole tensor (partial sums) -> this rank's equal chunk along ``dim``, summed over ranks."""
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter_along: dim {dim} has length {x.shape[dim]}, "
                         f"not divisible by the group size {n}")
    # [.., L, ..] -> [L, ..]
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    # [L/n, ..] -> [.., L/n, ..]
    return out.movedim(0, dim).contiguous()


class _AllGather(torch.autograd.Function):
    """Forward all-gather, backward reduce-scatter (Megatron ``_GatherFromSequenceParallelRegion``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward reduce-scatter, backward all-gather (Megatron ``_ReduceScatterToSequenceParallelRegion``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


def all_gather_along(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup) -> torch.Tensor:
    """S(dim) -> R over ``group``; backward sums the partial gradients and keeps this rank's chunk."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Partial sums -> S(dim) over ``group``; backward all-gathers the gradient."""
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceScatter.apply(x, dim, group)


def ring_shift(tensors: list[torch.Tensor], recv_shape: tuple[int, ...] | torch.Size, *,
               group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send each of ``tensors`` to the next rank of the ring; return what the previous rank sent.

    All tensors go in one ``batch_isend_irecv`` (one latency, as ring-flash-attention
    sends K and V together). No autograd: ring attention writes its own backward.
    ``recv_shape`` is the shape of each tensor the previous rank sends (chunks may
    differ with uneven lengths).
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, (rank + 1) % n)
    src = dist.get_global_rank(group, (rank - 1) % n)
    outs = [t.new_empty(recv_shape) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group=group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, out, src, group=group) for out in outs]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return outs


def all_reduce_sum(tensors: list[torch.Tensor], *, group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group`` (flattened into one all_reduce)."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def bare_all_to_all(buffer: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """One ``all_to_all_single`` of a flat buffer in equal blocks: the floor a switch is timed against."""
    out = torch.empty_like(buffer)
    dist.all_to_all_single(out, buffer, group=group)
    return out


def _paper_exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    chunks = torch.tensor_split(x, n, scatter_dim)
    shape = chunks[0].shape
    send = x.new_empty((n, *shape))
    for i, chunk in enumerate(chunks):          # copy 1: tensor_split -> .contiguous()
        send[i].copy_(chunk)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(list(recv.unbind(0)), dim=gather_dim)   # copy 2: torch.cat


class _PaperAllToAll(torch.autograd.Function):
    """Forward: scatter ``scatter_dim``, gather ``gather_dim``; backward: the same with the dims swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _paper_exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _paper_exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def paper_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, *,
                     group: dist.ProcessGroup) -> torch.Tensor:
    """The harness's all-to-all: ``x`` split in N equal parts along ``scatter_dim``, part i to rank i,
    the received parts concatenated along ``gather_dim`` in rank order. Autograd-aware."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if x.shape[scatter_dim] % n:
        raise ValueError(f"paper_all_to_all: dim {scatter_dim} has length {x.shape[scatter_dim]}, "
                         f"not divisible by the group size {n}")
    return _PaperAllToAll.apply(x, scatter_dim, gather_dim, group)
