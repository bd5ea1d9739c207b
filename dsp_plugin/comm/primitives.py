"""The DSP primitives: split, gather and dynamic_switch, and the gradient reduction.

Their collectives go through ``dsp_plugin.comm.collectives``, the only module of
the library that calls torch.distributed collectives
(``tests/test_comm_choke_point.py`` enforces it).

Placements follow DTensor's words: ``Shard(d)`` (printed ``S(d)``) means each rank
of the group holds one ``torch.tensor_split`` chunk of tensor dim ``d``;
``Replicate()`` (``R``) means every rank holds the full tensor.

=================  ==============  ========================  ==================
primitive          placement       collective                backward
=================  ==============  ========================  ==================
split              R    -> S(t)    none (local chunk)        gather
gather             S(c) -> R       one all_gather            split; partial_grad=True: reduce_scatter
dynamic_switch     S(c) -> S(t)    one all_to_all_single     switch S(t)->S(c)
=================  ==============  ========================  ==================

Gradient convention: each backward is the inverse primitive, no scaling. A rank's
parameter gradient is therefore the partial sum over the tokens it holds, and the
full gradient is the SUM over the DSP group (``reduce_gradients`` does that, and
averages over data parallelism). ``gather`` has two backwards, for its two kinds
of consumer (megatron-core's ``tensor_parallel_output_grad``): work that every
rank repeats on the full tensor gets the same gradient on every rank, and
``split`` keeps this rank's chunk of it; work that each rank does on its own shard
(a pair bias gathered for this rank's MSA rows) gets a *partial* gradient on each
rank, and ``partial_grad=True`` reduce-scatters it: the sum over the group, this
rank's chunk (the exact adjoint of the all_gather; its own backward gathers).

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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import checks, layout
from dsp_plugin.comm import payload, traced
from dsp_plugin.comm.agree import _agree, _check_global_len, _check_tensor, _normalize_dim
from dsp_plugin.comm.collectives import all_to_all_single
from dsp_plugin.comm.group_resolution import _member
from dsp_plugin.comm.reduce_scatter import _gather, _GatherPartial
from dsp_plugin.packing import chunk_sizes, join_blocks, split_blocks

__all__ = ["count_sharded_call", "dynamic_switch", "gather", "sharded_calls", "split"]

# How many split/dynamic_switch calls this process made on a group of size > 1.
# Integrations read it to notice a model that never sharded its activations
# (the DeepSpeed guard). A plain int: increments are atomic under the GIL.
_sharded_calls = 0


def sharded_calls() -> int:
    """Number of ``split``/``dynamic_switch`` calls so far on a group of size > 1 (in this process).

    Eager calls each count; under ``torch.compile`` a call counts when dynamo traces it (once per compiled
    graph, whatever the graph's later runs): a compiled model's first forward traces, so the DeepSpeed guard
    sees it shard (``dsp_plugin.deepspeed.guard``)."""
    return _sharded_calls


def _count_traced() -> int:
    """The count, made while dynamo traces: dynamo calls this at trace time and puts its result (a constant,
    unused) in the graph, so the graph neither reads nor guards on the counter (reading the global would
    guard the graph on its value: a recompile at every step, then eager)."""
    global _sharded_calls
    _sharded_calls += 1
    return 0


# what torch.compiler.assume_constant_result(_count_traced) does (torch/_dynamo/decorators.py sets this flag),
# without importing torch._dynamo when dsp_plugin is imported (seconds, and packages we do not declare: tqdm)
_count_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def count_sharded_call() -> None:
    """Record that a shard was made outside ``split``/``dynamic_switch`` (a plan's partial split): what the
    DeepSpeed guard reads through :func:`sharded_calls` to tell a DSP model from one that never shards.
    While ``torch.compile`` traces, counted once per trace (``_count_traced``)."""
    global _sharded_calls
    if torch.compiler.is_compiling():
        _count_traced()
    else:
        _sharded_calls += 1



# ---------------------------------------------------------------------------
# the data movement (no autograd here)
# ---------------------------------------------------------------------------


def _split_local(x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    # A copy, not a view: a view would keep the full tensor alive.
    return x.tensor_split(n, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def _switch(x: torch.Tensor, cur: int, tgt: int, cur_full: int, group: dist.ProcessGroup, n: int, rank: int,
            fold_for: int | None = None, wire: torch.dtype | None = None) -> torch.Tensor:
    """S(cur) -> S(tgt): one all_to_all_single between one pack and one unpack (see ``packing``).

    Shapes (other dims elided; c_i = rank i's chunk of cur, t_j = rank j's chunk of tgt):
      in   [.., c_rank, .., T_full, ..]
      send block j = in.narrow(tgt, t_j)       -> [.., c_rank, .., t_j, ..], to rank j
      recv block i from rank i                 -> [.., c_i, .., t_rank, ..]
      out  [.., C_full, .., t_rank, ..] = recv blocks concatenated along cur
    """
    plan = _SwitchBuffers(x, cur, tgt, cur_full, n, rank)
    if wire is None:
        all_to_all_single(plan.recv, plan.send, recv_splits=plan.recv_splits, send_splits=plan.send_splits,
                          group=group)
    else:  # the same blocks, each sent as ``wire`` bytes and its scale (``payload``)
        send_sizes = plan.send_splits or [plan.send.numel() // n] * n
        recv_sizes = plan.recv_splits or [plan.recv.numel() // n] * n
        rows = [[block] for block in plan.send.split(send_sizes)]
        received = payload.exchange(rows, [[(size,)] for size in recv_sizes], [wire], group, rank)
        plan.recv = torch.cat([row[0] for row in received])
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
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank, fold_for, wire=None):  # type: ignore[override]
        ctx.cur, ctx.tgt, ctx.group, ctx.n, ctx.rank, ctx.wire = cur, tgt, group, n, rank, wire
        ctx.tgt_full = x.shape[tgt]
        return _switch(x, cur, tgt, cur_full, group, n, rank, fold_for,
                       None if wire is None else wire.forward)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        wire = None if ctx.wire is None else ctx.wire.reversed()
        grad = _Switch.apply(grad, ctx.tgt, ctx.cur, ctx.tgt_full, ctx.group, ctx.n, ctx.rank, None, wire)
        return grad, None, None, None, None, None, None, None, None


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
    if torch.compiler.is_compiling():
        if n == 1:
            return x
        count_sharded_call()
        return traced.traced_split(x, _normalize_dim("split", "tgt_shard", tgt_shard, x.dim()), group, n, rank)
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
           global_len: int | None = None, partial_grad: bool = False) -> torch.Tensor:
    """Shard(cur_shard) -> Replicate: one all_gather along dim ``cur_shard``.

    ``global_len`` is the full length of dim ``cur_shard``. Without it the length
    comes from ``x``'s tag (``split``/``dynamic_switch`` outputs carry it), else
    from the group (one tiny all_gather and a host sync). A size-1 group returns ``x``.

    The backward depends on who uses the gathered tensor (docs/concepts.md, "Gradients by consumer"):

    - ``partial_grad=False``: every rank computes the same thing from it (the model's replicated tail, a
      loss), so every rank holds the same gradient; backward keeps this rank's chunk (no collective).
    - ``partial_grad=True``: each rank uses it for work on its own shard (a pair bias for this rank's MSA
      rows, the second operand of an outer product), so each rank holds a partial gradient; backward is one
      reduce_scatter: the sum over the group, this rank's chunk (megatron-core's
      ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``). Differentiable twice.
    """
    group, n, rank = _member("gather", group)
    if torch.compiler.is_compiling():
        dim = _normalize_dim("gather", "cur_shard", cur_shard, x.dim())
        _check_partial_grad(partial_grad)
        if n == 1:
            return x
        full = _traced_len("gather", global_len)
        if partial_grad:
            return traced.traced_gather_partial(x, dim, full, group, n, rank)
        return traced.traced_gather(x, dim, full, group, n, rank)
    error, dim, known = None, -1, None
    try:
        x = _check_tensor("gather", x)
        dim = _normalize_dim("gather", "cur_shard", cur_shard, x.dim())
        known = _check_global_len("gather", global_len)
        _check_partial_grad(partial_grad)
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return x
    if known is None and error is None:
        known = layout.global_len_of(x, dim)
    full = _agree("gather", x, cur=dim, tgt=-1, known_len=known, group=group, n=n, rank=rank, error=error,
                  partial_grad=partial_grad is True)
    if partial_grad:
        return _GatherPartial.apply(x, dim, full, group, n, rank)
    return _Gather.apply(x, dim, full, group, n, rank)


def _check_partial_grad(partial_grad: object) -> None:
    if not isinstance(partial_grad, bool):
        raise TypeError(f"gather: partial_grad must be a bool (True: the gathered tensor feeds work each rank does "
                        f"on its own shard, so its gradient is reduce-scattered; False: every rank computes the "
                        f"same from it), got {partial_grad!r}")


def _traced_len(name: str, global_len: int | None) -> int:
    """The full length a traced primitive needs at trace time: tags are not read inside a compiled region."""
    if global_len is None:
        raise ValueError(f"{name}: global_len=None under torch.compile; expected the full length of the sharded "
                         f"dim (a compiled region reads no shard tag and asks no group: that would be a host sync)")
    return global_len


def _prepare_switch(name: str, x: object, cur_shard: object, tgt_shard: object,
                    group: dist.ProcessGroup | None, global_len: object,
                    options: Callable[[torch.Tensor], Any],
                    wire: Callable[[Any], int] | None = None) -> tuple[Any, ...] | None:
    """Check a switch's arguments and agree with the group; None on a group of size 1.

    Returns ``(cur, tgt, cur_full, group, n, rank, options(x))``. ``options``
    checks the caller's own arguments; its errors travel like the others. ``wire``
    maps ``options(x)`` to the payload's ``checks.wire_code``, which the ranks compare.
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
    code = 0 if wire is None or extra is None else wire(extra)
    cur_full = _agree("dynamic_switch", x, cur=cur, tgt=tgt, known_len=known, group=group, n=n, rank=rank,
                      error=error, wire=code)
    count_sharded_call()
    return cur, tgt, cur_full, group, n, rank, extra


def dynamic_switch(x: torch.Tensor, cur_shard: int, tgt_shard: int, *,
                   group: dist.ProcessGroup | None = None, global_len: int | None = None,
                   fold_for: int | None = None, comm_dtype: object = None) -> torch.Tensor:
    """Shard(cur_shard) -> Shard(tgt_shard) with one ``all_to_all_single``.

    Every rank sends (N-1)/N of its shard: M(N-1)/N^2 bytes per rank for an
    activation of M bytes. The full length of dim ``cur_shard`` is ``global_len``,
    else ``x``'s tag, else asked of the group (see ``gather``). ``fold_for=a``
    lays the output out in memory with dim ``a`` second to last, so a block that
    attends along ``a`` folds the other dims into its batch without a copy
    (``dsp_plugin.packing.join_blocks``). Backward is the switch with the two
    dims exchanged. A size-1 group returns ``x``. ``comm_dtype="fp8"`` sends the
    blocks as FP8 with a scale each, forward and backward (``dsp_plugin.comm.payload``).
    """
    if torch.compiler.is_compiling():
        group, n, rank = _member("dynamic_switch", group)
        wire = payload.as_payload("dynamic_switch", comm_dtype)
        cur = _normalize_dim("dynamic_switch", "cur_shard", cur_shard, x.dim())
        tgt = _normalize_dim("dynamic_switch", "tgt_shard", tgt_shard, x.dim())
        if n == 1:
            return x
        count_sharded_call()
        full = _traced_len("dynamic_switch", global_len)
        if wire is not None:
            if not x.is_floating_point():
                raise ValueError(f"dynamic_switch: comm_dtype={comm_dtype!r} on a {x.dtype} tensor; expected a "
                                 f"floating-point activation")
            return traced.traced_wire_switch(x, cur, tgt, full, group, n, rank, wire)
        return traced.traced_switch(x, cur, tgt, full, group, n, rank)

    def options(x: torch.Tensor) -> tuple[int | None, payload.Payload | None]:
        wire = payload.as_payload("dynamic_switch", comm_dtype)
        if wire is not None and not x.is_floating_point():
            raise ValueError(f"dynamic_switch: comm_dtype={comm_dtype!r} on a {x.dtype} tensor; expected a "
                             f"floating-point activation")
        return (None if fold_for is None else _normalize_dim("dynamic_switch", "fold_for", fold_for, x.dim()),
                wire)

    def wire_of(extra: tuple[Any, payload.Payload | None]) -> int:
        fmt = extra[1]
        return 0 if fmt is None else checks.wire_code((fmt.forward,), (fmt.grad,))

    call = _prepare_switch("dynamic_switch", x, cur_shard, tgt_shard, group, global_len, options, wire_of)
    if call is None:
        return x
    cur, tgt, cur_full, group, n, rank, (fold_for, wire) = call
    out = _Switch.apply(x, cur, tgt, cur_full, group, n, rank, fold_for, wire)
    return layout.attach(out, tgt, x.shape[tgt])
