"""The head switch: full attention over a sequence-sharded activation, ``S(seq) -> S(heads) -> S(seq)``.

A block whose attention mixes every token with every token (full 3D attention)
has no sequence dim to keep sharded; the dim it does not mix is the head dim.
So q, k and v switch from the sequence to the heads, each rank attends over the
full sequence with its heads, and the output switches back (peers call this
Ulysses). ``to_heads`` moves the three in ONE packed ``all_to_all_single``
(diffusers sends them separately: 3 + 1 per attention), ``from_heads`` the
output in one more. Shapes (any dims; ``c_r`` rank r's chunk of the sequence
``S``, ``H`` query heads, ``h_r`` rank r's chunk of them, ``K_r`` the K/V heads
rank r's query heads read)::

    to_heads    q [.., c_r, .., H, ..]     ->  [.., S, .., h_r, ..]
                k, v [.., c_r, .., H_kv, ..] -> [.., S, .., K_r or h_r, ..]
    from_heads  out [.., S, .., h_r, ..]   ->  [.., c_r, .., H, ..]

Both dims are cut like ``torch.tensor_split`` (the first ``L % N`` ranks hold
one more), with uneven split sizes in the all-to-all, so nothing padded is ever
seen: with ``H % N != 0`` the ranks hold different head counts, and with
``N > H`` a rank holds none (its attention runs on an empty head dim).

GQA / MQA (``H_kv < H`` K/V heads, query head ``i`` reading K/V head
``i // (H / H_kv)``): each rank receives exactly the K/V heads ``K_r`` its query
heads read, inside the same all-to-all (a K/V head several ranks need is sent
to each of them). The result keeps the GQA rule locally: local query head ``i``
reads local K/V head ``i // (h_r / |K_r|)`` (what ``scaled_dot_product_attention
(enable_gqa=True)`` and ``repeat_interleave`` do); where a rank's query heads
straddle K/V groups unevenly, its K/V heads are repeated locally, after the
exchange, to one per query head. Elements each rank sends for K (and as many for
V), with ``c`` its tokens and ``row`` the elements of one token's head::

    this switch            c * row * sum_{j != r} |K_j|        (|K_j| <= min(h_j, H_kv))
    K/V repeated to H      c * row * sum_{j != r} h_j           = c*row*H*(N-1)/N for even heads
    K/V all-gathered       c * row * H_kv * (N - 1)

Between the two usual strategies, all-gathering beats repeating K/V up to H
heads when ``H_kv * (N - 1) < H * (N - 1) / N``, i.e. ``H / H_kv > N`` (counting
the block a rank keeps too, as some papers do, the bound reads ``H / H_kv >
N - 1``). Sending each rank only ``K_j`` is never more than either, and costs no
second collective, so it is the one strategy used; :func:`kv_elements_sent`
gives the three figures.

Backward of each is the other (the exact adjoint: a K/V head sent to several
ranks gets the sum of their gradients), itself differentiable, so double
backward goes through the collectives too. The sequence length comes from
``global_len=``, else the ``layout.ShardSpec`` tag of ``q`` (``split`` and
``dynamic_switch`` outputs carry one), else the group; the head count of
``from_heads`` from ``heads=``, else the group. Outputs
are tagged: ``to_heads``' q (and k, v without GQA) as ``S(head_dim)`` of ``H``,
``from_heads``' as ``S(seq_dim)`` of ``S``. The ranks compare fingerprints before
the exchange, as for the other primitives (``dsp_plugin.checks``). On a group of
size 1 both return their inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from dsp_plugin import checks, layout
from dsp_plugin.comm import agree, collectives, group_resolution, payload
from dsp_plugin.head_switch.arg_checks import check_qkv, check_replicated
from dsp_plugin.packing import chunk_sizes, offsets

__all__ = ["from_heads", "head_ranges", "kv_elements_sent", "kv_head_ranges", "local_head_counts", "to_heads"]

Range = tuple[int, int]  # (first head, number of heads)


def head_ranges(heads: int, n: int) -> list[Range]:
    """The ``tensor_split`` chunk of ``heads`` heads each of ``n`` ranks holds: ``[(first, count), ..]``."""
    sizes = chunk_sizes(heads, n)
    return list(zip(offsets(sizes), sizes))


def kv_head_ranges(heads: int, kv_heads: int, n: int) -> list[Range]:
    """The K/V heads each rank needs: those its chunk of the ``heads`` query heads reads (GQA grouping)."""
    per_group = heads // kv_heads
    ranges: list[Range] = []
    for start, count in head_ranges(heads, n):
        first, last = start // per_group, (start + count - 1) // per_group
        ranges.append((first, last - first + 1) if count else (0, 0))
    return ranges


def kv_elements_sent(*, heads: int, kv_heads: int, n: int, rank: int, tokens: int, row: int = 1) -> dict[str, int]:
    """Elements rank ``rank`` sends for K (V sends as many) under three strategies (module docstring)."""
    needed = kv_head_ranges(heads, kv_heads, n)
    query = head_ranges(heads, n)
    return {
        "this_switch": tokens * row * sum(count for j, (_, count) in enumerate(needed) if j != rank),
        "repeat_to_heads": tokens * row * sum(count for j, (_, count) in enumerate(query) if j != rank),
        "all_gather": tokens * row * kv_heads * (n - 1),
    }


def local_head_counts(heads: int, kv_heads: int, n: int, rank: int) -> tuple[int, int]:
    """``(query heads, K/V heads)`` rank ``rank`` holds after ``to_heads`` of ``heads`` query and ``kv_heads`` K/V
    heads over ``n`` ranks (K/V repeated to one per query head where its query heads straddle groups unevenly):
    what a core attention built for a fixed head count (Transformer Engine's) must be built for."""
    count = head_ranges(heads, n)[rank][1]
    if kv_heads == heads or _local_kv_index(heads, kv_heads, n, rank) is not None:
        return count, count
    return count, kv_head_ranges(heads, kv_heads, n)[rank][1]


def repeat_heads(t: torch.Tensor, index: list[int], head_dim: int) -> torch.Tensor:
    """``t.index_select(head_dim, index)`` for a non-decreasing ``index``, without an index tensor: one
    expanded view per run of equal entries, concatenated (no host-to-device copy of the index on every call)."""
    runs: list[list[int]] = []
    for head in index:
        if runs and runs[-1][0] == head:
            runs[-1][1] += 1
        else:
            runs.append([head, 1])
    views = []
    for head, count in runs:  # [.., 1, ..] -> [.., count, ..]: a view
        one = t.narrow(head_dim, head, 1)
        views.append(one.expand(*one.shape[:head_dim], count, *one.shape[head_dim + 1:]))
    return torch.cat(views, dim=head_dim)


def _local_kv_index(heads: int, kv_heads: int, n: int, rank: int) -> list[int] | None:
    """For each local query head, its local K/V head; None when the plain GQA rule already gives it."""
    (start, count), (first, kv_count) = head_ranges(heads, n)[rank], kv_head_ranges(heads, kv_heads, n)[rank]
    index = [(start + i) // (heads // kv_heads) - first for i in range(count)]
    if count == 0 or (count % kv_count == 0 and index == [i // (count // kv_count) for i in range(count)]):
        return None
    return index


@dataclass(frozen=True, eq=False)
class _Exchange:
    """One head switch, fixed before the collective: dims, sequence chunks and each tensor's head ranges."""

    seq_dim: int
    head_dim: int
    seq_sizes: tuple[int, ...]              # tokens of the sequence dim on each rank (tensor_split of S)
    ranges: tuple[tuple[Range, ...], ...]   # per tensor: the heads each rank holds in the S(heads) placement
    heads: tuple[int, ...]                  # per tensor: its full head count
    group: Any
    n: int
    rank: int
    replicated: tuple[bool, ...] = ()       # per tensor: its tokens are whole on every rank (joint attention)
    formats: tuple[torch.dtype | None, ...] = ()       # per tensor: its wire format (None: its dtype; payload.py)
    grad_formats: tuple[torch.dtype | None, ...] = ()  # per tensor: its gradient's, in the adjoint

    def adjoint(self) -> _Exchange:
        """The exchange of the gradients: the same, with the two payload formats exchanged."""
        return replace(self, formats=self.grad_formats, grad_formats=self.formats)

    def shape(self, t: torch.Tensor, tokens: int, heads: int) -> list[int]:
        shape = list(t.shape)
        shape[self.seq_dim], shape[self.head_dim] = tokens, heads
        return shape

    def whole(self, k: int) -> bool:
        return k < len(self.replicated) and self.replicated[k]


def _exchange_blocks(blocks: list[list[torch.Tensor]], recv_shapes: list[list[list[int]]],
                     ex: _Exchange) -> list[list[torch.Tensor]]:
    """Send ``blocks[j]`` to rank ``j`` in ONE all-to-all; return rank ``i``'s blocks, shaped ``recv_shapes[i]``.

    Pack: one copy per block into a flat send buffer. Unpack: views of the flat receive buffer.
    With ``ex.formats`` (FP8 for some tensors), the buffer is ``payload``'s bytes, one scale per chunk.
    """
    if any(f is not None for f in ex.formats):  # traced too: payload's bytes, no autograd (``_TracedWire``)
        return payload.exchange(blocks, recv_shapes, ex.formats, ex.group, ex.rank)
    if torch.compiler.is_compiling():  # traced: torch ops around a functional all-to-all (comm/traced.py)
        # rows [1, numel] joined along dim 1, not flat blocks: see traced.traced_switch (an empty block's gradient)
        send = torch.cat([block.reshape(1, -1) for row in blocks for block in row], dim=1).reshape(-1)
        recv_splits = [sum([math.prod(shape) for shape in row]) for row in recv_shapes]
        recv = collectives.traced_all_to_all(send, send_splits=[sum([b.numel() for b in row]) for row in blocks],
                                             recv_splits=recv_splits, group=ex.group)
        parts = [list(row_recv.split([math.prod(shape) for shape in row])) for row_recv, row in
                 zip(recv.split(recv_splits), recv_shapes)]
        return [[part.view(shape) for part, shape in zip(row_parts, row)] for row_parts, row in zip(parts, recv_shapes)]
    flat = [block for row in blocks for block in row]
    send = flat[0].new_empty(sum(block.numel() for block in flat))
    start = 0
    for block in flat:
        send[start:start + block.numel()].view(block.shape).copy_(block)
        start += block.numel()
    recv = collectives._all_to_all_flat(send, [sum(block.numel() for block in row) for row in blocks],
                                 [sum(math.prod(shape) for shape in row) for row in recv_shapes], ex.group)
    received, start = [], 0
    for row in recv_shapes:
        views = []
        for shape in row:
            views.append(recv[start:start + math.prod(shape)].view(shape))
            start += math.prod(shape)
        received.append(views)
    return received


def _seq_to_heads(tensors: tuple[torch.Tensor, ...], ex: _Exchange) -> tuple[torch.Tensor, ...]:
    """Each ``[.., c_rank, .., H_t, ..] -> [.., S, .., |R_rank(t)|, ..]``, all in one all-to-all.

      send block j = for each t: t.narrow(head, R_j(t))     [.., c_rank, .., |R_j(t)|, ..]  -> rank j
      recv block i = for each t:                            [.., c_i,    .., |R_rank(t)|, ..] from rank i
      out t        = its recv blocks concatenated along seq in rank order
    A replicated t (``ex.whole``, R tokens on every rank) receives ``[.., R, .., |R_rank(t)|, ..]`` from
    each rank and sums them: a reduce-scatter over heads, the adjoint of ``_heads_to_seq``'s all-gather.
    """
    received = _exchange_blocks(
        [[t.narrow(ex.head_dim, *r[j]) for t, r in zip(tensors, ex.ranges)] for j in range(ex.n)],
        [[ex.shape(t, t.shape[ex.seq_dim] if ex.whole(k) else tokens, r[ex.rank][1])
          for k, (t, r) in enumerate(zip(tensors, ex.ranges))] for tokens in ex.seq_sizes], ex)
    return tuple(torch.stack([row[k] for row in received]).sum(0) if ex.whole(k) else
                 torch.cat([row[k] for row in received], dim=ex.seq_dim) for k in range(len(tensors)))


def _heads_to_seq(tensors: tuple[torch.Tensor, ...], ex: _Exchange) -> tuple[torch.Tensor, ...]:
    """The adjoint: each ``[.., S, .., |R_rank(t)|, ..] -> [.., c_rank, .., H_t, ..]`` in one all-to-all.

      send block i = for each t: t.narrow(seq, c_i)         [.., c_i,    .., |R_rank(t)|, ..] -> rank i
      recv block j = for each t:                            [.., c_rank, .., |R_j(t)|, ..]  from rank j
      out t        = block j in heads R_j(t): concatenated where the ranges tile the heads, else summed
    A replicated t (``ex.whole``) is sent whole to every rank: an all-gather over heads in the same exchange.
    """
    starts, mine = offsets(ex.seq_sizes), ex.seq_sizes[ex.rank]
    received = _exchange_blocks(
        [[t if ex.whole(k) else t.narrow(ex.seq_dim, starts[i], ex.seq_sizes[i]) for k, t in enumerate(tensors)]
         for i in range(ex.n)],
        [[ex.shape(t, t.shape[ex.seq_dim] if ex.whole(k) else mine, r[j][1])
          for k, (t, r) in enumerate(zip(tensors, ex.ranges))] for j in range(ex.n)], ex)
    outputs = []
    for k, (t, r, total) in enumerate(zip(tensors, ex.ranges, ex.heads)):
        blocks = [row[k] for row in received]
        held = [(first, count) for first, count in r if count]
        if [first for first, _ in held] == offsets([count for _, count in held]):  # the ranges tile the heads
            outputs.append(torch.cat(blocks, dim=ex.head_dim))
            continue
        out = t.new_zeros(ex.shape(t, blocks[0].shape[ex.seq_dim], total))
        for (first, count), block in zip(r, blocks):  # a head several ranks held: sum their parts
            out.narrow(ex.head_dim, first, count).add_(block)
        outputs.append(out)
    return tuple(outputs)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex, *tensors):  # type: ignore[override]
        ctx.ex = ex
        return _seq_to_heads(tensors, ex)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *_FromHeads.apply(ctx.ex.adjoint(), *grads))


class _FromHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex, *tensors):  # type: ignore[override]
        ctx.ex = ex
        return _heads_to_seq(tensors, ex)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *_ToHeads.apply(ctx.ex.adjoint(), *grads))


class _TracedWire(torch.autograd.Function):
    """The head switch with an FP8 payload under ``torch.compile``: ``_ToHeads``' (``to_heads=True``) or
    ``_FromHeads``' forward, the payload's bytes through one functional all-to-all without autograd, and as
    backward the other switch of the gradients in their own wire formats (``ex.adjoint()``), as eager's
    ``_ToHeads``/``_FromHeads`` send them: the eager FP8 head switch's values bit for bit. (The traced switch
    without a payload needs none of this: funcol's autograd all-to-all is its own adjoint; a payload's ``uint8``
    bytes have no gradient.) Its backward is not differentiable again (as ``traced._TracedWireSwitch``)."""

    @staticmethod
    def forward(ctx, ex, to_heads, *tensors):  # type: ignore[override]
        ctx.ex, ctx.to_heads = ex, to_heads
        return _seq_to_heads(tensors, ex) if to_heads else _heads_to_seq(tensors, ex)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        adjoint = ctx.ex.adjoint()
        return (None, None, *(_heads_to_seq(grads, adjoint) if ctx.to_heads else _seq_to_heads(grads, adjoint)))


def _traced(ex: _Exchange, to_heads: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The traced head switch: funcol's autograd all-to-all, or with a payload ``_TracedWire`` (where a gradient
    is wanted: without one, dynamo inlines the Function's forward and fails on its ``ctx.ex`` assignment,
    ``FrozenInstanceError``, which outside ``fullgraph`` is a graph break)."""
    if any(f is not None for f in ex.formats) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _TracedWire.apply(ex, to_heads, *tensors)
    return _seq_to_heads(tensors, ex) if to_heads else _heads_to_seq(tensors, ex)


def to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int, head_dim: int,
             group: Any = None, global_len: int | None = None,
             replicated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, comm_dtype: object = None,
             exact: tuple[str, ...] = ()) -> tuple[torch.Tensor, ...]:
    """q, k, v sharded ``S(seq_dim)`` -> the full sequence, sharded ``S(head_dim)``: ONE packed all-to-all.

    ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA): each rank gets the
    K/V heads its query heads read (module docstring). ``global_len`` is the
    full sequence length (default: ``q``'s tag, else asked of the group).
    ``replicated=(q_t, k_t, v_t)``: tokens every rank holds whole (text in joint
    attention), ``[.., R, .., H, ..]``; they are narrowed to this rank's heads
    with no communication (backward: the gradient of those heads, zeros elsewhere,
    the project's partial adjoint), R is compared across ranks in the same check,
    and they are returned after q, k, v (six tensors).
    Backward: one packed all-to-all back. A size-1 group returns the inputs.
    ``comm_dtype="fp8"``: q, k, v travel as FP8 with a scale per chunk, forward and backward
    (``dsp_plugin.comm.payload``), except those named in ``exact`` (``("k",)``: K keeps its dtype).
    """
    return _to_heads(q, k, v, seq_dim=seq_dim, head_dim=head_dim, group=group, global_len=global_len,
                     replicated=replicated, comm_dtype=comm_dtype, exact=exact)


def wire_formats(where: str, comm_dtype: object, names: tuple[str, ...], exact: object = ()
                 ) -> tuple[tuple[torch.dtype | None, ...], tuple[torch.dtype | None, ...]]:
    """Per tensor named in ``names``: (its forward wire format, its gradient's); ``exact`` ones keep their dtype."""
    wire = payload.as_payload(where, comm_dtype)
    if not isinstance(exact, (tuple, list, set, frozenset)) or any(e not in names for e in exact):
        raise ValueError(f"{where}: exact={exact!r}; expected a tuple of names among {names}")
    if wire is None:
        return (), ()
    return (tuple(None if name in exact else wire.forward for name in names),
            tuple(None if name in exact else wire.grad for name in names))


def _to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int, head_dim: int, group: Any,
              global_len: int | None, replicated: tuple[torch.Tensor, ...] | None,
              error: Exception | None = None, comm_dtype: object = None,
              exact: tuple[str, ...] = ()) -> tuple[torch.Tensor, ...]:
    """``to_heads``; ``error``: the caller's own argument error, raised on every rank after the check."""
    group, n, rank = group_resolution._member("to_heads", group)
    seq, head, kv_heads, known, count = -1, -1, 0, None, -1
    formats: tuple[tuple[torch.dtype | None, ...], ...] = ((), ())
    try:
        if error is not None:
            raise error
        seq, head, kv_heads = check_qkv(q, k, v, seq_dim, head_dim)
        formats = wire_formats("to_heads", comm_dtype, ("q", "k", "v"), exact)
        if replicated is not None:
            replicated = check_replicated("to_heads", replicated, (q, k, v), seq, head)
            count = replicated[0].shape[seq]
        known = agree._check_global_len("to_heads", global_len)
        if known is None:
            known = layout.global_len_of(q, seq)
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return (q, k, v) if replicated is None else (q, k, v, *replicated)
    # the fingerprint covers k and v too: q's shape followed by (K/V heads, k's and v's head size)
    probe = q if error is not None else torch.empty((), dtype=q.dtype, device=q.device).expand(
        *q.shape, kv_heads, k.shape[-1], v.shape[-1])
    if torch.compiler.is_compiling() and error is None and known is not None:
        full = known  # traced: no cross-rank check (a host sync); autograd through the functional all-to-all
    else:
        full = agree._agree("to_heads", probe, cur=seq, tgt=head, known_len=known, group=group, n=n, rank=rank,
                           error=error, replicated=count, wire=checks.wire_code(*formats))
    heads = q.shape[head]
    q_ranges, kv_ranges = tuple(head_ranges(heads, n)), tuple(kv_head_ranges(heads, kv_heads, n))
    ex = _Exchange(seq, head, tuple(chunk_sizes(full, n)), (q_ranges, kv_ranges, kv_ranges),
                   (heads, kv_heads, kv_heads), group, n, rank, (), *formats)
    compiling = torch.compiler.is_compiling()
    outputs = list(_traced(ex, True, q, k, v) if compiling else _ToHeads.apply(ex, q, k, v))
    if replicated is not None:  # this rank's heads of the tokens it holds whole: no communication
        outputs += [t.narrow(head, *r[rank]) for t, r in zip(replicated, ex.ranges)]
    index = _local_kv_index(heads, kv_heads, n, rank)
    if index is not None:  # this rank's query heads straddle K/V groups: one K/V head per query head
        for i in (1, 2) if replicated is None else (1, 2, 4, 5):  # the K and V among the outputs
            outputs[i] = repeat_heads(outputs[i], index, head)
    layout.attach(outputs[0], head, heads)
    if kv_heads == heads:
        layout.attach(outputs[1], head, heads)
        layout.attach(outputs[2], head, heads)
    return tuple(outputs)


def from_heads(out: torch.Tensor, *, seq_dim: int, head_dim: int, group: Any = None,
               global_len: int | None = None, heads: int | None = None,
               replicated: torch.Tensor | None = None,
               comm_dtype: object = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``S(head_dim)`` with the full sequence -> ``S(seq_dim)`` with every head: one all-to-all.

    ``heads`` is the full head count (default: asked of the group, one tiny
    all-gather and a host sync; not read from a tag, because a rank holding no
    head has an empty tensor, whose tag does not survive ``detach``, and every
    rank must decide alike whether to ask). ``global_len``, if given, must be the sequence
    length ``out`` holds. ``replicated``: the output of the tokens every rank holds
    whole, ``[.., R, .., h_rank, ..]``; it travels in the same all-to-all (each rank
    sends its heads of it to every rank: an all-gather over heads, whose backward
    sums the ranks' gradients, a reduce-scatter) and ``(out, replicated)`` come back,
    the second with every head, the same on every rank.
    Backward: the switch to heads. A size-1 group returns its inputs. ``comm_dtype="fp8"``: the
    output (and ``replicated``) travel as FP8 with a scale per chunk (``dsp_plugin.comm.payload``).
    """
    group, n, rank = group_resolution._member("from_heads", group)
    error, seq, head, known, count = None, -1, -1, None, -1
    formats: tuple[tuple[torch.dtype | None, ...], ...] = ((), ())
    try:
        formats = wire_formats("from_heads", comm_dtype, ("out", "replicated"))
        out = agree._check_tensor("from_heads", out)
        seq = agree._normalize_dim("from_heads", "seq_dim", seq_dim, out.dim())
        head = agree._normalize_dim("from_heads", "head_dim", head_dim, out.dim())
        if seq == head:
            raise ValueError(f"from_heads: seq_dim={seq_dim} and head_dim={head_dim} are both dim {seq}; "
                             f"expected two different dims")
        length = agree._check_global_len("from_heads", global_len)
        if length is not None and length != out.shape[seq]:
            raise ValueError(f"from_heads: global_len={length}, but out holds {out.shape[seq]} tokens on dim "
                             f"{seq}; expected the full sequence on every rank (as to_heads leaves it)")
        if heads is not None:
            known = agree._as_int("from_heads", "heads", heads)
            if known < 1:
                raise ValueError(f"from_heads: heads={heads!r}; expected the full head count, >= 1")
        if replicated is not None:
            (replicated,) = check_replicated("from_heads", (replicated,), (out,), seq, head)
            count = replicated.shape[seq]
    except (TypeError, ValueError) as exc:
        if n == 1:
            raise
        error = exc
    if n == 1:
        return out if replicated is None else (out, replicated)
    if torch.compiler.is_compiling() and error is None and known is not None:
        total = known  # traced (see to_heads)
    else:
        wire = checks.wire_code(*(f[:1 if replicated is None else 2] for f in formats))
        total = agree._agree("from_heads", out, cur=head, tgt=seq, known_len=known, group=group, n=n, rank=rank,
                            error=error, replicated=count, wire=wire)
    apply = (lambda ex, *ts: _traced(ex, False, *ts)) if torch.compiler.is_compiling() else _FromHeads.apply
    ranges = tuple(head_ranges(total, n))
    if replicated is None:
        ex = _Exchange(seq, head, tuple(chunk_sizes(out.shape[seq], n)), (ranges,), (total,), group, n, rank, (),
                       *(f[:1] for f in formats))
        (result,) = apply(ex, out)
        return layout.attach(result, seq, out.shape[seq])
    ex = _Exchange(seq, head, tuple(chunk_sizes(out.shape[seq], n)), (ranges, ranges), (total, total), group, n,
                   rank, (False, True), *formats)
    result, whole = apply(ex, out, replicated)
    return layout.attach(result, seq, out.shape[seq]), whole
