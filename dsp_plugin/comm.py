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
the sharded dim cannot be seen locally: it travels with the data, as a tag that
``split`` and ``dynamic_switch`` put on their outputs (``dsp_plugin.layout``);
``global_len=`` overrides it, and without either the group is asked (one tiny
all_gather and a host sync).

Cross-rank agreement: before a collective the ranks may compare fingerprints of
the call (``dsp_plugin.checks``; ``DSP_CHECK=1`` always, by default the first
call of each signature), so a disagreement raises the same clear error on every
rank instead of aborting gloo or returning garbage. A rank's own argument error
goes through that exchange too, so its peers stop with it.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dsp_plugin import checks, layout
from dsp_plugin.packing import chunk_sizes, join_blocks, offsets, split_blocks

if TYPE_CHECKING:
    from dsp_plugin.topology import Topology

__all__ = [
    "NoTopologyError",
    "all_reduce_mean",
    "meet_and_close",
    "chunk_sizes",
    "count_sharded_call",
    "dynamic_switch",
    "exchange_words",
    "gather",
    "group_rank",
    "group_size",
    "reduce_gradients",
    "sharded_calls",
    "split",
    "switch_apply",
]

# How many split/dynamic_switch calls this process made on a group of size > 1.
# Integrations read it to notice a model that never sharded its activations
# (the DeepSpeed guard). A plain int: increments are atomic under the GIL.
_sharded_calls = 0


def sharded_calls() -> int:
    """Number of ``split``/``dynamic_switch`` calls so far on a group of size > 1 (in this process)."""
    return _sharded_calls


def count_sharded_call() -> None:
    """Record that a shard was made outside ``split``/``dynamic_switch`` (a plan's partial split): what the
    DeepSpeed guard reads through :func:`sharded_calls` to tell a DSP model from one that never shards."""
    global _sharded_calls
    _sharded_calls += 1


# ---------------------------------------------------------------------------
# groups, arguments and the cross-rank agreement
# ---------------------------------------------------------------------------


class NoTopologyError(RuntimeError):
    """``group=None`` on more than one rank with no topology installed; raised alike on every rank."""


def no_topology_message(name: str) -> str:
    """What ``group=None`` without a topology says (also the text ``reduce_gradients`` raises)."""
    return (f"{name}: group=None means the DSP group of the installed topology, but none is installed and the "
            f"world has {dist.get_world_size()} ranks; refusing to shard over the whole world (a framework that "
            f"reduces gradients its own way would train silently wrong). Fix: after init_process_group call "
            f"dsp_plugin.set_topology(dsp_plugin.Topology.build(dsp=N)) (Topology.world() for one DSP group of "
            f"every rank), or pass group= explicitly. Under DeepSpeed: the config needs "
            f"\"sequence_parallel_mode\": \"dsp\" with \"sequence_parallel_size\": N, and the engine must come "
            f"from dsp_plugin.deepspeed.initialize (it installs the topology).")


def _resolve_group(group: dist.ProcessGroup | None, name: str = "dsp_plugin") -> dist.ProcessGroup | None:
    """``None`` -> the DSP group of the installed topology; an error on > 1 rank without one.

    Returns None when torch.distributed is not initialised: a single process is
    a DSP group of size 1 (so is a world of one rank).
    """
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    if topology is not None:
        return topology.dsp_group
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    raise NoTopologyError(no_topology_message(name))


def _group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int]:
    group = _resolve_group(group, "group_size")
    return group, (1 if group is None else dist.get_world_size(group))


def _member(name: str, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, size, rank in group); a clear error at once for a group this process is not in."""
    group = _resolve_group(group, name)
    if group is None:
        return None, 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"it was given (ranks {dist.get_process_group_ranks(group)}); expected a group that "
                         f"contains this rank, or group=None for the DSP group")
    return group, dist.get_world_size(group), rank


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (resolved as in the primitives); 1 without torch.distributed."""
    return _group_and_size(group)[1]


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group``; 0 without torch.distributed."""
    group = _resolve_group(group, "group_rank")
    return 0 if group is None else dist.get_rank(group)


def _as_int(name: str, arg: str, value: object) -> int:
    """Any integral value (int, numpy integer, 0-dim integer tensor), never bool or float."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: {arg} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: {arg} must be an int, got {value!r}") from None


def _normalize_dim(name: str, arg: str, dim: object, ndim: int) -> int:
    dim = _as_int(name, arg, dim)
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


def _check_global_len(name: str, given: object) -> int | None:
    if given is None:
        return None
    value = _as_int(name, "global_len", given) if not isinstance(given, bool) else -1
    if value < 0:
        raise ValueError(f"{name}: global_len must be a non-negative int, got {given!r}")
    return value


def _exchange(fingerprint: list[int], device: torch.device, group: dist.ProcessGroup, n: int) -> list[list[int]]:
    """Every rank's fingerprint, by group rank: one small all_gather and a host sync."""
    mine = torch.tensor(fingerprint, dtype=torch.int64, device=device)
    table = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
    with checks.exchanging():
        _all_gather_tensor(table, mine, group)
    return table.view(n, -1).tolist()


def exchange_words(words: list[int], *, group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every rank's int64 ``words``, padded to a fingerprint's length, by group rank (one all_gather).

    The same collective, size and group as the primitives' first-call check, so
    an integration's agreement (the DeepSpeed guard) meets a peer that is waiting
    in a primitive's check, and both judge the mixed table, instead of the two
    waiting in different collectives. The first word says whose row it is.
    """
    if len(words) > checks.LENGTH:
        raise ValueError(f"exchange_words: {len(words)} words; at most {checks.LENGTH}")
    return _exchange(list(words) + [0] * (checks.LENGTH - len(words)), device, group,
                     dist.get_world_size(group))


def _exchange_device(x: object, group: dist.ProcessGroup) -> torch.device:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(name: str, x: object, *, cur: int, tgt: int, known_len: int | None, group: dist.ProcessGroup,
           n: int, rank: int, error: Exception | None, replicated: int = -1) -> int:
    """Agree with the group before the collective; return the full length of dim ``cur`` (-1 if none).

    ``error`` is this rank's own argument error: it is raised after the
    exchange, on every rank alike, so no peer is left waiting in a collective.
    ``replicated``: tokens the call carries whole on every rank beside the shard
    (the head switch's joint attention), compared across ranks. Without a check
    and with the length known, this costs nothing.
    """
    tensor = x if isinstance(x, torch.Tensor) and error is None else None
    shape = [] if tensor is None else list(tensor.shape)
    local = shape[cur] if tensor is not None and cur >= 0 else -1
    if tensor is not None and cur >= 0:
        shape[cur] = -1
    ranks = dist.get_process_group_ranks(group)
    fingerprint = checks.CallFingerprint(
        op=name, dtype=None if tensor is None else tensor.dtype, shape=tuple(shape), cur=cur, tgt=tgt,
        global_len=-1 if known_len is None else known_len, local_len=local, group_size=n,
        group_hash=checks.group_hash(ranks), device="cpu" if tensor is None else tensor.device.type,
        error="" if error is None else f"{type(error).__name__}: {error}", replicated=replicated)
    if checks.needs_check(fingerprint) or (cur >= 0 and known_len is None):
        table = _exchange(fingerprint.encode(), _exchange_device(x, group), group, n)
        try:
            full = checks.judge(name, table, ranks, chunk_sizes)
        except checks.CrossRankMismatch as mismatch:
            if error is not None:
                raise mismatch from error
            raise
        checks.remember(fingerprint.signature())
        return full
    if error is not None:
        raise error
    if cur >= 0 and local != chunk_sizes(known_len, n)[rank]:  # type: ignore[arg-type]
        raise ValueError(f"{name}: rank {rank} holds {local} of dim {cur}, but global_len={known_len} "
                         f"split over {n} ranks gives it {chunk_sizes(known_len, n)[rank]}")  # type: ignore[arg-type]
    return -1 if cur < 0 else known_len  # type: ignore[return-value]


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


def _switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int, rank: int,
            fold_for: int | None = None) -> torch.Tensor:
    """S(cur) -> S(tgt): one all_to_all_single between one pack and one unpack (see ``packing``).

    Shapes (other dims elided; c_i = rank i's chunk of cur, t_j = rank j's chunk of tgt):
      in   [.., c_rank, .., T_full, ..]
      send block j = in.narrow(tgt, t_j)       -> [.., c_rank, .., t_j, ..], to rank j
      recv block i from rank i                 -> [.., c_i, .., t_rank, ..]
      out  [.., C_full, .., t_rank, ..] = recv blocks concatenated along cur
    """
    plan = _SwitchBuffers(x, cur, tgt, cur_full, n, rank)
    dist.all_to_all_single(plan.recv, plan.send, output_split_sizes=plan.recv_splits,
                           input_split_sizes=plan.send_splits, group=group)
    return plan.unpack(fold_for)


class _SwitchBuffers:
    """The packed send buffer of ``x`` for S(cur) -> S(tgt), the receive buffer, and their split sizes."""

    def __init__(self, x: torch.Tensor, cur: int, tgt: int, cur_full: int, n: int, rank: int) -> None:
        self.send, self.send_splits = split_blocks(x, tgt, n)
        self.block_shape = list(x.shape)
        self.block_shape[tgt] = chunk_sizes(x.shape[tgt], n)[rank]
        self.cur, self.cur_sizes = cur, chunk_sizes(cur_full, n)
        per_cur_row = math.prod(s for d, s in enumerate(self.block_shape) if d != cur)
        self.recv_splits = None if len(set(self.cur_sizes)) == 1 else [per_cur_row * c for c in self.cur_sizes]
        self.recv = x.new_empty(per_cur_row * cur_full)

    def unpack(self, fold_for: int | None = None) -> torch.Tensor:
        return join_blocks(self.recv, self.block_shape, self.cur, self.cur_sizes, fold_for=fold_for)


# ---------------------------------------------------------------------------
# autograd functions: each backward is the inverse primitive, itself differentiable
# (so a gradient penalty's double backward goes through the collectives too)
# ---------------------------------------------------------------------------


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.n, ctx.rank, ctx.full = dim, group, n, rank, x.shape[dim]
        return _split_local(x, dim, n, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _Gather.apply(grad, ctx.dim, ctx.full, ctx.group, ctx.n, ctx.rank), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, full, group, n, rank):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.n, ctx.rank = dim, group, n, rank
        return _gather(x, dim, full, group, n)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _Split.apply(grad, ctx.dim, ctx.group, ctx.n, ctx.rank), None, None, None, None, None


class _Switch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank, fold_for):  # type: ignore[override]
        ctx.cur, ctx.tgt, ctx.group, ctx.n, ctx.rank = cur, tgt, group, n, rank
        ctx.tgt_full = x.shape[tgt]
        return _switch(x, cur, tgt, cur_full, group, n, rank, fold_for)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = _Switch.apply(grad, ctx.tgt, ctx.cur, ctx.tgt_full, ctx.group, ctx.n, ctx.rank, None)
        return grad, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------
# public API (paper appendix A.4)
# ---------------------------------------------------------------------------


def split(x: torch.Tensor, tgt_shard: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Replicate -> Shard(tgt_shard): keep this rank's ``tensor_split`` chunk of dim ``tgt_shard``.

    No communication (but see ``dsp_plugin.checks`` for the cross-rank check).
    The output is tagged with the full length (``dsp_plugin.layout``), so a later
    switch or gather needs no ``global_len``. Backward gathers the gradient (one
    all_gather). A size-1 group returns ``x``.
    """
    group, n, rank = _member("split", group)
    error, dim = None, -1
    try:
        x = _check_tensor("split", x)
        dim = _normalize_dim("split", "tgt_shard", tgt_shard, x.dim())
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return x
    _agree("split", x, cur=-1, tgt=dim, known_len=None, group=group, n=n, rank=rank, error=error)
    count_sharded_call()
    return layout.attach(_Split.apply(x, dim, group, n, rank), dim, x.shape[dim])


def gather(x: torch.Tensor, cur_shard: int, *, group: dist.ProcessGroup | None = None,
           global_len: int | None = None) -> torch.Tensor:
    """Shard(cur_shard) -> Replicate: one all_gather along dim ``cur_shard``.

    ``global_len`` is the full length of dim ``cur_shard``. Without it the length
    comes from ``x``'s tag (``split``/``dynamic_switch`` outputs carry it), else
    from the group (one tiny all_gather and a host sync). Backward keeps this
    rank's chunk of the gradient. A size-1 group returns ``x``.
    """
    group, n, rank = _member("gather", group)
    error, dim, known = None, -1, None
    try:
        x = _check_tensor("gather", x)
        dim = _normalize_dim("gather", "cur_shard", cur_shard, x.dim())
        known = _check_global_len("gather", global_len)
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return x
    if known is None and error is None:
        known = layout.global_len_of(x, dim)
    full = _agree("gather", x, cur=dim, tgt=-1, known_len=known, group=group, n=n, rank=rank, error=error)
    return _Gather.apply(x, dim, full, group, n, rank)


def _prepare_switch(name: str, x: object, cur_shard: object, tgt_shard: object,
                    group: dist.ProcessGroup | None, global_len: object,
                    options: Callable[[torch.Tensor], Any]) -> tuple[Any, ...] | None:
    """Check a switch's arguments and agree with the group; None on a group of size 1.

    Returns ``(cur, tgt, cur_full, group, n, rank, options(x))``. ``options``
    checks the caller's own arguments; its errors travel like the others.
    """
    group, n, rank = _member(name, group)
    error, cur, tgt, known, extra = None, -1, -1, None, None
    try:
        x = _check_tensor(name, x)
        cur = _normalize_dim(name, "cur_shard", cur_shard, x.dim())
        tgt = _normalize_dim(name, "tgt_shard", tgt_shard, x.dim())
        if cur == tgt:
            raise ValueError(f"{name}: cur_shard={cur_shard} equals tgt_shard={tgt_shard} "
                             f"(both are dim {cur} of a {x.dim()}-dim tensor); expected two different dims")
        extra = options(x)
        known = _check_global_len(name, global_len)
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return None
    if known is None and error is None:
        known = layout.global_len_of(x, cur)  # type: ignore[arg-type]
    # the fingerprint names the collective's primitive: both callers issue a switch
    cur_full = _agree("dynamic_switch", x, cur=cur, tgt=tgt, known_len=known, group=group, n=n, rank=rank,
                      error=error)
    count_sharded_call()
    return cur, tgt, cur_full, group, n, rank, extra


def dynamic_switch(x: torch.Tensor, cur_shard: int, tgt_shard: int, *,
                   group: dist.ProcessGroup | None = None, global_len: int | None = None,
                   fold_for: int | None = None) -> torch.Tensor:
    """Shard(cur_shard) -> Shard(tgt_shard) with one ``all_to_all_single``.

    Every rank sends (N-1)/N of its shard: M(N-1)/N^2 bytes per rank for an
    activation of M bytes. The full length of dim ``cur_shard`` is ``global_len``,
    else ``x``'s tag, else asked of the group (see ``gather``). ``fold_for=a``
    lays the output out in memory with dim ``a`` second to last, so a block that
    attends along ``a`` folds the other dims into its batch without a copy
    (``dsp_plugin.packing.join_blocks``). Backward is the switch with the two
    dims exchanged. A size-1 group returns ``x``.
    """
    def options(x: torch.Tensor) -> int | None:
        return None if fold_for is None else _normalize_dim("dynamic_switch", "fold_for", fold_for, x.dim())

    call = _prepare_switch("dynamic_switch", x, cur_shard, tgt_shard, group, global_len, options)
    if call is None:
        return x
    cur, tgt, cur_full, group, n, rank, fold_for = call
    out = _Switch.apply(x, cur, tgt, cur_full, group, n, rank, fold_for)
    return layout.attach(out, tgt, x.shape[tgt])


# ---------------------------------------------------------------------------
# overlap: the switch of one batch chunk in flight while the previous one computes
# ---------------------------------------------------------------------------


class _SwitchStart(torch.autograd.Function):
    """Pack and launch the all-to-all; returns the receive buffer, filled once ``_SwitchFinish`` waits."""

    @staticmethod
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank, pending):  # type: ignore[override]
        plan = _SwitchBuffers(x, cur, tgt, cur_full, n, rank)
        work = dist.all_to_all_single(plan.recv, plan.send, output_split_sizes=plan.recv_splits,
                                      input_split_sizes=plan.send_splits, group=group, async_op=True)
        pending.update(work=work, plan=plan)
        ctx.group, ctx.n, ctx.tgt = group, n, tgt
        ctx.splits = (plan.send_splits, plan.recv_splits)
        ctx.x_shape = list(x.shape)
        return plan.recv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_recv):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        # the forward's exchange reversed: block i goes back to rank i, block j comes from rank j
        grad_send = grad_recv.new_empty(math.prod(ctx.x_shape))
        dist.all_to_all_single(grad_send, grad_recv.contiguous(), output_split_sizes=send_splits,
                               input_split_sizes=recv_splits, group=ctx.group)
        tgt_sizes = chunk_sizes(ctx.x_shape[ctx.tgt], ctx.n)
        return join_blocks(grad_send, ctx.x_shape, ctx.tgt, tgt_sizes), None, None, None, None, None, None, None


class _SwitchFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, cur, n, pending):  # type: ignore[override]
        pending.pop("work").wait()
        plan = pending.pop("plan")          # its send buffer may be freed from here on
        ctx.cur, ctx.n = cur, n
        return join_blocks(recv, plan.block_shape, cur, plan.cur_sizes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        return split_blocks(grad, ctx.cur, ctx.n)[0], None, None, None


def switch_apply(x: torch.Tensor, fn, cur_shard: int, tgt_shard: int, *, chunks: int = 2,  # noqa: ANN001
                 chunk_dim: int = 0, group: dist.ProcessGroup | None = None,
                 global_len: int | None = None) -> torch.Tensor:
    """``fn(dynamic_switch(x, cur_shard, tgt_shard))``, with communication hidden behind computation.

    ``x`` is cut into ``chunks`` along ``chunk_dim`` (a batch dim: neither shard
    dim). The all-to-all of chunk ``i + 1`` is in flight (``async_op``) while
    ``fn`` runs on chunk ``i``; the results are concatenated along ``chunk_dim``.
    Same bytes and one collective per chunk; ``fn`` must treat chunks
    independently (a transformer block does: it never mixes samples). Backward
    is correct but not overlapped, and not differentiable twice (use
    ``dynamic_switch`` for a gradient penalty).
    """
    def options(x: torch.Tensor) -> int:
        batch = _normalize_dim("switch_apply", "chunk_dim", chunk_dim, x.dim())
        if _as_int("switch_apply", "chunks", chunks) < 1:
            raise ValueError(f"switch_apply: chunks={chunks}; expected a positive int")
        if batch in (_normalize_dim("switch_apply", "cur_shard", cur_shard, x.dim()),
                     _normalize_dim("switch_apply", "tgt_shard", tgt_shard, x.dim())):
            raise ValueError(f"switch_apply: chunk_dim={chunk_dim} is one of the shard dims "
                             f"({cur_shard}, {tgt_shard}); expected a batch dim")
        return batch

    call = _prepare_switch("switch_apply", x, cur_shard, tgt_shard, group, global_len, options)
    if call is None:
        return fn(x)
    cur, tgt, cur_full, group, n, rank, batch = call
    pieces = [p for p in x.tensor_split(chunks, dim=batch) if p.shape[batch] > 0]

    def start(piece: torch.Tensor) -> tuple[torch.Tensor, dict]:
        pending: dict = {}
        return _SwitchStart.apply(piece, cur, tgt, cur_full, group, n, rank, pending), pending

    outputs, in_flight = [], start(pieces[0])
    for i in range(len(pieces)):
        following = start(pieces[i + 1]) if i + 1 < len(pieces) else None
        recv, pending = in_flight
        outputs.append(fn(_SwitchFinish.apply(recv, cur, n, pending)))
        in_flight = following  # type: ignore[assignment]
    out = torch.cat(outputs, dim=batch)
    return layout.attach(out, tgt, x.shape[tgt]) if out.dim() == x.dim() else out


# ---------------------------------------------------------------------------
# gradient reduction
# ---------------------------------------------------------------------------


def reduce_gradients(parameters: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]], *,
                     topology: Topology | None = None) -> None:
    """Sum gradients over the DSP axis and average them over data parallelism.

    One all_reduce(SUM) of all gradients flattened together over the DP x DSP
    group, then a division by the DP size. After it every rank holds the
    gradient of the single-process run of the whole global batch (when the
    loss is a mean over samples). ``parameters`` may be ``model.parameters()``
    or ``model.named_parameters()`` (names then appear in errors).

    A parameter this rank did not use (``.grad`` is None: a token or a head
    owned by another rank) takes part as zeros, and one flag per parameter
    travels in the same all_reduce, so afterwards every rank has a gradient for
    exactly the parameters some rank used. The parameter lists must match
    across ranks (count, shapes, dtypes): checked like the primitives' calls
    (``dsp_plugin.checks``: the first call of each signature by default), with
    an error naming the first parameter that differs. Without a topology on
    more than one rank this refuses (``NoTopologyError``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    named = [(item if isinstance(item, tuple) else (f"#{i}", item)) for i, item in enumerate(parameters)]
    named = [(name, p) for name, p in named if p.requires_grad or p.grad is not None]
    from dsp_plugin.topology import get_topology

    topology = topology if topology is not None else get_topology()
    if topology is None:
        if dist.get_world_size() == 1:
            return
        raise NoTopologyError(no_topology_message("reduce_gradients"))
    group, dp = topology.dp_dsp_group, topology.dp
    if group is None or dist.get_world_size(group) == 1 or not named:  # a topology without groups: one process
        return
    # first over the DSP group, where a peer still inside a primitive's check would be waiting
    for checked in dict.fromkeys(g for g in (topology.dsp_group, group) if g is not None and
                                 dist.get_world_size(g) > 1):
        _agree_parameter_list(named, checked)
    dtype = _common_dtype([p.grad if p.grad is not None else p for _, p in named])
    device = named[0][1].device
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format))
              .reshape(-1).to(dtype) for _, p in named]
    pieces.append(torch.tensor([float(p.grad is not None) for _, p in named], dtype=dtype, device=device))
    flat = torch.cat(pieces)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    used = flat[-len(named):].tolist()
    if dp > 1:
        flat.div_(dp)
    offset = 0
    for (_, p), anyone in zip(named, used):
        chunk = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if anyone == 0:
            continue                     # no rank used it: it stays without a gradient, as on one process
        if p.grad is None:
            p.grad = chunk.to(p.dtype).clone(memory_format=torch.contiguous_format)
        else:
            p.grad.copy_(chunk)


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype




def _agree_parameter_list(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """The ranks' parameter lists match (count, shapes, dtypes) before the flat all_reduce, else a clear error.

    Exchanged when ``checks`` says so (by default the first time this process
    sees the list); a mismatch is judged from the same table on every rank. The
    row has the primitives' check format, so a peer waiting in a primitive's
    check on the same group meets this one and both raise.
    """
    shapes = [(tuple(p.shape), str(p.dtype)) for _, p in named]
    key = ("reduce_gradients", tuple(dist.get_process_group_ranks(group)), tuple(shapes))
    if not checks.needs_check_for(key):
        return
    n = dist.get_world_size(group)
    device = _exchange_device(named[0][1], group)
    table = exchange_words([checks.PARAMS_MAGIC, len(named), zlib.crc32(repr(shapes).encode())],
                           group=group, device=device)
    if all(row == table[0] for row in table):
        checks.remember(key)
        return
    ranks = dist.get_process_group_ranks(group)
    elsewhere = [r for r, row in zip(ranks, table) if row[0] != checks.PARAMS_MAGIC]
    if elsewhere:
        raise ValueError(f"reduce_gradients: rank(s) {elsewhere} of group {ranks} are inside a DSP primitive "
                         f"while the others reduce gradients: their forward issued more DSP primitives; "
                         f"expected the same model, DSP-aware alike, on every rank")
    counts = [row[1] for row in table]
    if len(set(counts)) > 1:
        raise ValueError(f"reduce_gradients: the ranks of group {ranks} pass different numbers of parameters "
                         f"({', '.join(f'{c} on rank {r}' for r, c in zip(ranks, counts))}); expected the same "
                         f"parameters on every rank (pass model.parameters() of the same model everywhere)")
    sizes = _exchange([p.numel() * 64 + _DTYPE_CODES.get(p.dtype, 63) for _, p in named], device, group, n)
    for i, (name, p) in enumerate(named):
        column = [row[i] for row in sizes]
        if len(set(column)) > 1:
            described = ", ".join(f"{v // 64} elements on rank {r}" for r, v in zip(ranks, column))
            raise ValueError(f"reduce_gradients: parameter {name} differs across group {ranks}: {described} "
                             f"(or another dtype); expected the same parameters on every rank")
    raise ValueError(f"reduce_gradients: the parameter shapes of group {ranks} differ (same sizes, other "
                     f"shapes); expected the same parameters on every rank")


_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


def all_reduce_mean(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Mean of ``tensor`` over ``group`` (a new tensor; for logging losses across DP ranks)."""
    out = tensor.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out.div_(dist.get_world_size(group))
    return out


def meet_and_close() -> None:
    """Every rank meets once more, then the default process group is destroyed (a launch's clean exit).

    Leaving gloo's teardown to interpreter shutdown lets a rank that exits first abort its peer.
    Call it only where every rank is known to be at the same point (never after an error).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# the head switch's exchange (dsp_plugin.heads packs, checks and unpacks; this sends)
# ---------------------------------------------------------------------------


def _all_to_all_flat(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                     group: dist.ProcessGroup) -> torch.Tensor:
    """One ``all_to_all_single`` of a flat buffer cut into per-rank blocks (sizes in elements, any may be 0).

    Returns the flat receive buffer: rank ``i``'s block at offset ``sum(recv_splits[:i])``.
    """
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return recv
