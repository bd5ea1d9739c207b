"""The DSP primitives: split, gather and dynamic_switch, and the gradient reduction.

This is the ONLY module of the library that calls torch.distributed collectives
(``tests/test_comm_choke_point.py`` enforces it), so every byte DSP moves goes
through the few functions below.

Placements follow DTensor's words: ``Shard(d)`` (printed ``S(d)``) means each rank
of the group holds one ``torch.tensor_split`` chunk of tensor dim ``d``;
``Replicate()`` (``R``) means every rank holds the full tensor.

=================  ==============  ========================  ==================
primitive          placement       collective                backward
=================  ==============  ========================  ==================
split              R    -> S(t)    none (local chunk)        gather
gather             S(c) -> R       one all_gather            split
dynamic_switch     S(c) -> S(t)    one all_to_all_single     switch S(t)->S(c)
=================  ==============  ========================  ==================

Gradient convention: each backward is the exact adjoint (the inverse primitive,
no scaling). A rank's parameter gradient is therefore the partial sum over the
tokens it holds, and the full gradient is the SUM over the DSP group
(``reduce_gradients`` does that, and averages over data parallelism).

Uneven lengths: a dim of length L on N ranks is cut like ``torch.tensor_split``
(the first ``L % N`` ranks hold one more). The all-to-all takes uneven split
sizes directly, so no padding is visible to the caller. Only the full length of
the sharded dim cannot be seen locally; pass it as ``global_len`` (the DSP plan
does) or let the primitive recover it with one tiny all_gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dsp_plugin.topology import Topology

__all__ = [
    "all_reduce_mean",
    "chunk_sizes",
    "dynamic_switch",
    "gather",
    "group_rank",
    "group_size",
    "reduce_gradients",
    "sharded_calls",
    "split",
]

# How many split/dynamic_switch calls this process made on a group of size > 1.
# Integrations read it to notice a model that never sharded its activations
# (the DeepSpeed guard). A plain int: increments are atomic under the GIL.
_sharded_calls = 0


def sharded_calls() -> int:
    """Number of ``split``/``dynamic_switch`` calls so far on a group of size > 1 (in this process)."""
    return _sharded_calls


def _count_sharded_call() -> None:
    global _sharded_calls
    _sharded_calls += 1

# ---------------------------------------------------------------------------
# groups and sizes
# ---------------------------------------------------------------------------


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``None`` -> the DSP group of the current topology, else the whole world.

    Returns None when torch.distributed is not initialised: a single process is
    a DSP group of size 1.
    """
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    return topology.dsp_group if topology is not None else dist.group.WORLD


def _group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int]:
    group = _resolve_group(group)
    return group, (1 if group is None else dist.get_world_size(group))


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (resolved as in the primitives); 1 without torch.distributed."""
    return _group_and_size(group)[1]


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group``; 0 without torch.distributed."""
    group = _resolve_group(group)
    return 0 if group is None else dist.get_rank(group)


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(length), parts)``: the first ``length % parts`` get one more."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _numel_without(shape: Sequence[int], dim: int) -> int:
    """Number of elements in one slice of ``shape`` at a fixed index of ``dim``."""
    count = 1
    for d, size in enumerate(shape):
        if d != dim:
            count *= size
    return count


def _normalize_dim(name: str, arg: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{name}: {arg} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}: {arg}={dim} is out of range for a tensor with {ndim} dims "
                         f"(expected -{ndim} <= {arg} < {ndim})")
    return dim % ndim


def _check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with at least 1 dim, got a 0-dim tensor")
    return x


def _check_global_len(name: str, given: int | None) -> None:
    if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 0):
        raise ValueError(f"{name}: global_len must be a non-negative int, got {given!r}")


def _global_len(name: str, x: torch.Tensor, dim: int, given: int | None,
                group: dist.ProcessGroup | None, n: int, rank: int) -> int:
    """Full length of sharded dim ``dim``; checked against the local chunk when given."""
    local = x.shape[dim]
    if given is None:
        # One tiny collective: every rank's local length. Callers that know the
        # length (the DSP plan) pass it and skip this.
        lengths = torch.empty(n, dtype=torch.int64, device=x.device)
        _all_gather_tensor(lengths, torch.tensor([local], dtype=torch.int64, device=x.device), group)
        sizes = lengths.tolist()
        total = sum(sizes)
        if sizes != chunk_sizes(total, n):
            raise ValueError(f"{name}: local lengths of dim {dim} across the group are {sizes}, "
                             f"which is not a torch.tensor_split of {total} into {n}")
        return total
    expected = chunk_sizes(given, n)[rank]
    if local != expected:
        raise ValueError(f"{name}: rank {rank} holds {local} of dim {dim}, but global_len={given} "
                         f"split over {n} ranks gives it {expected}")
    return given


# ---------------------------------------------------------------------------
# the data movement (no autograd here)
# ---------------------------------------------------------------------------


def _all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_fn(out, inp, group=group)


def _split_local(x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    # A copy, not a view: a view would keep the full tensor alive.
    return x.tensor_split(n, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, dim: int, full: int, group: dist.ProcessGroup, n: int,
            rank: int) -> torch.Tensor:
    """S(dim) -> R with one all_gather of equal-size (padded) blocks."""
    sizes = chunk_sizes(full, n)
    block = max(sizes)
    padded_shape = list(x.shape)
    padded_shape[dim] = block
    # pack: local chunk into a block of the largest chunk size (padding stays internal)
    if x.shape[dim] == block:
        send = x.contiguous()
    else:
        send = x.new_zeros(padded_shape)
        send.narrow(dim, 0, x.shape[dim]).copy_(x)
    # gloo wants the output as blocks concatenated along dim 0: (n * p0, p1, ..)
    recv = x.new_empty((n * padded_shape[0], *padded_shape[1:]))
    _all_gather_tensor(recv, send, group)
    recv = recv.view(n, *padded_shape)
    # unpack: (n, ..., block, ...) -> (..., full, ...), dropping each block's padding
    out_shape = list(x.shape)
    out_shape[dim] = full
    if block * n == full:
        return recv.movedim(0, dim).flatten(dim, dim + 1).contiguous()
    out = x.new_empty(out_shape)
    for i, (start, size) in enumerate(zip(_offsets(sizes), sizes)):
        out.narrow(dim, start, size).copy_(recv[i].narrow(dim, 0, size))
    return out


def _switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup,
            n: int, rank: int) -> torch.Tensor:
    """S(cur) -> S(tgt): one all_to_all_single, one pack copy, one unpack copy.

    Shapes (other dims elided; c_i = rank i's chunk of cur, t_j = rank j's chunk of tgt):
      in   [.., c_rank, .., T_full, ..]
      send blocks j = 0..n-1, block j = in.narrow(tgt, t_j)   -> [.., c_rank, .., t_j, ..]
      recv blocks i = 0..n-1, block i from rank i             -> [.., c_i, .., t_rank, ..]
      out  [.., C_full, .., t_rank, ..] = blocks concatenated along cur
    """
    tgt_sizes = chunk_sizes(x.shape[tgt], n)
    cur_sizes = chunk_sizes(cur_full, n)
    numel_per_tgt_row = _numel_without(x.shape, tgt)
    # pack: block j holds the tgt-chunk destined to rank j, contiguous and in order
    send = x.new_empty(x.numel())
    send_splits = [numel_per_tgt_row * t for t in tgt_sizes]
    for start, size, off, count in zip(_offsets(tgt_sizes), tgt_sizes, _offsets(send_splits), send_splits):
        block_shape = list(x.shape)
        block_shape[tgt] = size
        send[off:off + count].view(block_shape).copy_(x.narrow(tgt, start, size))
    # what rank i sends me: its cur chunk c_i times my tgt chunk
    recv_shape = list(x.shape)
    recv_shape[tgt] = tgt_sizes[rank]
    per_cur_row = _numel_without(recv_shape, cur)
    recv_splits = [per_cur_row * c for c in cur_sizes]
    recv = x.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    # unpack: concatenate the received blocks along cur
    out_shape = list(recv_shape)
    out_shape[cur] = cur_full
    out = x.new_empty(out_shape)
    for start, size, off, count in zip(_offsets(cur_sizes), cur_sizes, _offsets(recv_splits), recv_splits):
        block_shape = list(recv_shape)
        block_shape[cur] = size
        out.narrow(cur, start, size).copy_(recv[off:off + count].view(block_shape))
    return out


# ---------------------------------------------------------------------------
# autograd functions: each backward is the inverse primitive
# ---------------------------------------------------------------------------


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.n, ctx.rank, ctx.full = dim, group, n, rank, x.shape[dim]
        return _split_local(x, dim, n, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather(grad.contiguous(), ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, full, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.n, ctx.rank = dim, n, rank
        return _gather(x, dim, full, group, n, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _split_local(grad, ctx.dim, ctx.n, ctx.rank), None, None, None, None, None


class _Switch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank):  # type: ignore[override]
        ctx.cur, ctx.tgt, ctx.group, ctx.n, ctx.rank = cur, tgt, group, n, rank
        ctx.tgt_full = x.shape[tgt]
        return _switch(x, cur, tgt, cur_full, group, n, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = _switch(grad.contiguous(), ctx.tgt, ctx.cur, ctx.tgt_full, ctx.group, ctx.n, ctx.rank)
        return grad, None, None, None, None, None, None


# ---------------------------------------------------------------------------
# public API (paper appendix A.4)
# ---------------------------------------------------------------------------


def split(x: torch.Tensor, tgt_shard: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Replicate -> Shard(tgt_shard): keep this rank's ``tensor_split`` chunk of dim ``tgt_shard``.

    No communication. Backward gathers the gradient (one all_gather), so the
    input gradient is the full one on every rank. A size-1 group returns ``x``.
    """
    x = _check_tensor("split", x)
    dim = _normalize_dim("split", "tgt_shard", tgt_shard, x.dim())
    group, n = _group_and_size(group)
    if n == 1:
        return x
    _count_sharded_call()
    return _Split.apply(x, dim, group, n, dist.get_rank(group))


def gather(x: torch.Tensor, cur_shard: int, *, group: dist.ProcessGroup | None = None,
           global_len: int | None = None) -> torch.Tensor:
    """Shard(cur_shard) -> Replicate: one all_gather along dim ``cur_shard``.

    ``global_len`` is the full length of dim ``cur_shard``; without it one tiny
    all_gather of the local lengths recovers it. Backward keeps this rank's
    chunk of the gradient. A size-1 group returns ``x``.
    """
    x = _check_tensor("gather", x)
    dim = _normalize_dim("gather", "cur_shard", cur_shard, x.dim())
    _check_global_len("gather", global_len)
    group, n = _group_and_size(group)
    if n == 1:
        return x
    rank = dist.get_rank(group)
    full = _global_len("gather", x, dim, global_len, group, n, rank)
    return _Gather.apply(x, dim, full, group, n, rank)


def dynamic_switch(x: torch.Tensor, cur_shard: int, tgt_shard: int, *,
                   group: dist.ProcessGroup | None = None, global_len: int | None = None) -> torch.Tensor:
    """Shard(cur_shard) -> Shard(tgt_shard) with one ``all_to_all_single``.

    Every rank sends (N-1)/N of its shard: M(N-1)/N^2 bytes per rank for an
    activation of M bytes. ``global_len`` is the full length of dim
    ``cur_shard`` (see the module docstring). Backward is the switch with the
    two dims exchanged. A size-1 group returns ``x``.
    """
    x = _check_tensor("dynamic_switch", x)
    cur = _normalize_dim("dynamic_switch", "cur_shard", cur_shard, x.dim())
    tgt = _normalize_dim("dynamic_switch", "tgt_shard", tgt_shard, x.dim())
    if cur == tgt:
        raise ValueError(f"dynamic_switch: cur_shard={cur_shard} equals tgt_shard={tgt_shard} "
                         f"(both are dim {cur} of a {x.dim()}-dim tensor); expected two different dims")
    _check_global_len("dynamic_switch", global_len)
    group, n = _group_and_size(group)
    if n == 1:
        return x
    rank = dist.get_rank(group)
    cur_full = _global_len("dynamic_switch", x, cur, global_len, group, n, rank)
    _count_sharded_call()
    return _Switch.apply(x, cur, tgt, cur_full, group, n, rank)


# ---------------------------------------------------------------------------
# gradient reduction
# ---------------------------------------------------------------------------


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], *, topology: Topology | None = None) -> None:
    """Sum gradients over the DSP axis and average them over data parallelism.

    One all_reduce(SUM) of all gradients flattened together over the DP x DSP
    group, then a division by the DP size. After it every rank holds the
    gradient of the single-process run of the whole global batch (when the
    loss is a mean over samples). Without a topology the whole world is one
    DSP group (DP = 1).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or not (dist.is_available() and dist.is_initialized()):
        return
    from dsp_plugin.topology import get_topology

    topology = topology if topology is not None else get_topology()
    group = topology.dp_dsp_group if topology is not None else dist.group.WORLD
    dp = topology.dp if topology is not None else 1
    if dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if dp > 1:
        flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_mean(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Mean of ``tensor`` over ``group`` (a new tensor; for logging losses across DP ranks)."""
    out = tensor.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out.div_(dist.get_world_size(group))
    return out
