"""The wire format of an all-to-all's payload: the activation's own dtype, or FP8 with a scale per chunk.

``comm_dtype="fp8"`` (a switch's, a head switch's, a plan's option) sends each
chunk -- one tensor's block for one destination rank -- as FP8 bytes followed by
its scale (4 bytes, float32), all in the same ``all_to_all_single`` of one flat
``uint8`` buffer, and casts back to the activation's dtype after the receive.
The scale is ``amax(|finite values of the chunk|) / top(format)``, computed on the
device (no host sync): e4m3 has no infinity, so its maximum (448) stands for one and
``top`` is the value below it (416); e5m2 has its own, and ``top`` is its maximum (57344).
A chunk of ``e`` elements of a 2-byte activation therefore costs ``e + 4`` bytes instead of ``2 e``: per rank and per tensor, ``(bf16 bytes) / 2 + 4 (N - 1)``,
what ``CommAccounting`` reports, since it counts the ``uint8`` buffer actually sent.
The block a rank keeps for itself never travels, so it is kept exact.

Formats (``Payload``): forward ``float8_e4m3fn`` (3 mantissa bits, range 448);
backward ``float8_e4m3fn`` too. The usual argument for ``e5m2`` in backward
(Transformer Engine's "hybrid" recipe) is the gradients' dynamic range under a
per-*tensor* scale; here every chunk has its own scale, so a chunk must hold only
its own range, and the extra mantissa bit halves the rounding error. Measured on
the tiny STDiT's and Wan's backward switches (``tests/test_fp8_loss_parity.py``
prints it): mean relative round-trip error 0.022 / 0.026 in e4m3 against
0.035 / 0.050 in e5m2, and no element flushed to zero in either (measured with the
finite top of 416, issue 52; 0.022 / 0.025 with 448 before).
``Payload(grad=torch.float8_e5m2)`` selects e5m2 for a model whose gradient
chunks span more than e4m3's ~2^17.

Non-finite values arrive as they were sent, as on the exact wire: ``+inf`` and ``-inf``
come back infinite (in e4m3 they travel as +-448), ``NaN`` as NaN, and the
chunk's finite values keep their own scale (an ``inf`` taken into the amax made the scale
infinite and every value of the chunk NaN). Nothing is refused: telling would need a host sync.

A tensor that must stay exact (K in the head switch: attention logits amplify its
error) is named in ``exact``: its chunks travel as raw bytes of its dtype in the
same buffer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsp_plugin.comm import collectives

__all__ = ["FP8", "Payload", "as_payload", "decode", "encode", "exchange", "round_trip_errors", "wire_bytes"]

_SCALE_BYTES = 4  # one float32 per chunk


@dataclass(frozen=True)
class Payload:
    """An all-to-all's wire dtypes: ``forward`` for the activation, ``grad`` for its gradient (the adjoint)."""

    forward: torch.dtype = torch.float8_e4m3fn
    grad: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        for name in ("forward", "grad"):
            value = getattr(self, name)
            if value not in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"Payload({name}={value!r}); expected torch.float8_e4m3fn or torch.float8_e5m2")

    def reversed(self) -> Payload:
        """The adjoint's payload: the gradient format forward (a double backward sends activations again)."""
        return Payload(self.grad, self.forward)


FP8 = Payload()


def as_payload(where: str, comm_dtype: object) -> Payload | None:
    """``comm_dtype`` as given by a user: None (the activation's dtype), ``"fp8"``, a float8 dtype, a Payload."""
    if comm_dtype is None or isinstance(comm_dtype, Payload):
        return comm_dtype
    if comm_dtype == "fp8":
        return FP8
    if comm_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return Payload(comm_dtype, comm_dtype)  # type: ignore[arg-type]
    raise ValueError(f"{where}: comm_dtype={comm_dtype!r}; expected None (send the activation's dtype), 'fp8' "
                     f"(e4m3 with a scale per chunk), torch.float8_e4m3fn, torch.float8_e5m2 or a "
                     f"dsp_plugin.comm.payload.Payload")


def _chunk_bytes(numel: int, fmt: torch.dtype | None, itemsize: int) -> int:
    return numel * itemsize if fmt is None else numel + _SCALE_BYTES


def wire_bytes(shapes: Sequence[Sequence[int]], formats: Sequence[torch.dtype | None], itemsize: int) -> int:
    """Bytes of one destination's row: each tensor's chunk, of ``shapes[k]``, in ``formats[k]`` (None: raw)."""
    return sum(_chunk_bytes(math.prod(s), f, itemsize) for s, f in zip(shapes, formats))


_measured: list[dict[str, Any]] | None = None


@contextlib.contextmanager
def round_trip_errors() -> Iterator[list[dict[str, Any]]]:
    """Record every FP8 chunk sent inside the block: ``{"format", "backward", "rel_error", "flushed"}``.

    ``rel_error`` is ``||decode(encode(c)) - c|| / ||c||`` of the chunk (what the receiver gets, computed on
    the sender), ``flushed`` the fraction of its nonzero elements that arrive as 0. For reports, not for
    training: it costs a host sync per chunk. Not thread-safe (one recorder per process).
    """
    global _measured
    outer, _measured = _measured, []
    try:
        yield _measured
    finally:
        _measured = outer


def _limits(fmt: torch.dtype) -> tuple[float, float]:
    """``fmt``'s (largest value a finite value travels as, what stands for +-inf on the wire): e4m3fn has no
    infinity, so its maximum (448) stands for one and finite values stop a step below (416); e5m2's cast is not
    saturating (after the scale a finite value never exceeds its maximum), so its own infinity travels.
    Computed from ``torch.finfo`` here, not read from a module-level table: under ``torch.compile(dynamic=True)``
    a float read from a module-level name (a table, ``math.inf``) became a graph input, which the traced
    switch's backward could not take ("lift_tracked_freevar_to_input should not be called on root")."""
    top = torch.finfo(fmt).max
    return (top, float("inf")) if fmt == torch.float8_e5m2 else (top - 32.0, top)


def _decoded(wire: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """FP8 values (``fmt``) times their scale, in float32; the wire's infinity (``_limits``) is +-inf."""
    values = wire.float()
    inf = _limits(fmt)[1]
    if inf == float("inf"):   # the format's own infinity: inf * scale is inf
        return values * scale
    return torch.where(values.abs() == inf, values * float("inf"), values * scale)


def _round_trip(chunk: torch.Tensor, wire: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> dict[str, Any]:
    original = chunk.float()
    back = _decoded(wire, scale, fmt)
    norm = original.norm().item()
    nonzero = original != 0
    return {"format": str(fmt).removeprefix("torch."), "backward": torch._C._current_graph_task_id() != -1,
            "rel_error": (back - original).norm().item() / norm if norm else 0.0,
            "flushed": ((back == 0) & nonzero).sum().item() / max(int(nonzero.sum().item()), 1)}


def _amax_rows(chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunks (flat, one tensor's, one per destination) -> (``[m]`` float32 amax of the finite values of each,
    ``[m, e]`` of them all when they have one length ``e``, else None). Equal lengths: one reduction for all;
    uneven: one each. Non-finite values count as 0 here: they travel as themselves (see ``_decoded``)."""
    lengths = [c.numel() for c in chunks]
    if lengths[0] and all(n == lengths[0] for n in lengths):
        packed = torch.cat(chunks).view(len(chunks), lengths[0])
        return packed.abs().nan_to_num(0.0, 0.0, 0.0).amax(1).float(), packed
    zero = chunks[0].new_zeros(1, dtype=torch.float32)
    return torch.cat([c.abs().nan_to_num(0.0, 0.0, 0.0).amax(0, keepdim=True).float() if c.numel() else zero
                      for c in chunks]), None


def _cast(scaled: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Scaled values (finite ones within the finite top, ``_limits``) in ``fmt``: +-inf as the wire's infinity,
    NaN as NaN."""
    inf = _limits(fmt)[1]
    return (scaled if inf == float("inf") else scaled.clamp(-inf, inf)).to(fmt)


def _encode_chunks(chunks: Sequence[torch.Tensor], fmt: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One tensor's chunks (flat) -> ``(fmt values as uint8, float32 scale as uint8)`` per chunk.

    The same values as casting each chunk on its own (amax, scale, divide, clamp, cast are elementwise or
    per-chunk), in a handful of kernels for all chunks of one length instead of several per chunk: eagerly
    on a GPU the encode is launch-bound at a switch's sizes (docs/gpu.md)."""
    amax, packed = _amax_rows(chunks)
    scales = (amax / _limits(fmt)[0]).clamp_min(torch.finfo(torch.float32).tiny)  # [m]; a zero chunk: any will do
    if packed is not None:
        wires = list(_cast(packed.float() / scales[:, None], fmt).unbind(0))
    else:
        wires = [_cast(c.float() / scales[i], fmt) for i, c in enumerate(chunks)]
    # the bytes of all scales at once: Inductor (torch 2.11 on CUDA) refuses to bitcast a [1] piece of a float32
    # tensor it has laid out with stride 0 ("self.stride(-1) must be 1 to view Float as Byte ... but got 0")
    scale_bytes = scales.view(torch.uint8)
    out = []
    for i, (chunk, wire) in enumerate(zip(chunks, wires)):
        if _measured is not None:
            _measured.append(_round_trip(chunk, wire, scales[i:i + 1], fmt))
        out.append((wire.view(torch.uint8), scale_bytes[_SCALE_BYTES * i:_SCALE_BYTES * (i + 1)]))
    return out


def encode(rows: Sequence[Sequence[torch.Tensor]], formats: Sequence[torch.dtype | None], *, skip: int = -1
           ) -> tuple[torch.Tensor, list[int]]:
    """``rows[j]``: the chunks for rank ``j``, one per tensor -> (one flat uint8 buffer, bytes per rank).

    Chunk ``k`` is ``formats[k]`` bytes then its float32 scale, or (None) the raw bytes of its dtype.
    Row ``skip`` (this rank's own) is left out: it does not travel.
    """
    sent = [j for j in range(len(rows)) if j != skip]
    columns: list[list[tuple[torch.Tensor, ...]]] = []  # [tensor k][i-th sent row]: its byte pieces
    width = min([len(rows[j]) for j in sent]) if sent else 0  # tensors per row (not min(default=): dynamo)
    for k, fmt in enumerate(formats[:width]):
        flats = [rows[j][k].reshape(-1) for j in sent]
        if fmt is None:
            columns.append([(flat.contiguous().view(torch.uint8),) for flat in flats])
        else:
            columns.append(_encode_chunks(flats, fmt))  # type: ignore[arg-type]
    parts: list[torch.Tensor] = []
    splits = [0] * len(rows)
    for i, j in enumerate(sent):
        for column in columns:
            parts.extend(column[i])
            splits[j] += sum(p.numel() for p in column[i])
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=rows[0][0].device), splits
    return torch.cat(parts), splits


def decode(recv: torch.Tensor, shapes: Sequence[Sequence[Sequence[int]]], formats: Sequence[torch.dtype | None],
           dtype: torch.dtype, *, skip: int = -1) -> list[list[torch.Tensor] | None]:
    """The inverse of ``encode`` on the receive side: rank ``i``'s chunks, shaped ``shapes[i][k]``, in ``dtype``
    (row ``skip``: None, it did not travel). Byte offsets need not be aligned: scales and raw chunks are copied.
    An FP8 tensor whose chunks have one length is cast back in one go for all source ranks."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    came = [i for i in range(len(shapes)) if i != skip]
    offsets: dict[tuple[int, int], int] = {}  # (source i, tensor k) -> the chunk's first byte
    start = 0
    for i in came:
        for k, (shape, fmt) in enumerate(zip(shapes[i], formats)):
            offsets[i, k] = start
            start += _chunk_bytes(math.prod(shape), fmt, itemsize)
    out: list[list[torch.Tensor] | None] = [None if i == skip else [] for i in range(len(shapes))]
    for k, fmt in enumerate(formats):
        have = [i for i in came if (i, k) in offsets]
        numels = [math.prod(shapes[i][k]) for i in have]
        for i, numel in zip(have, numels):
            at = offsets[i, k]
            if fmt is None:
                out[i].append(recv[at:at + numel * itemsize].clone().view(dtype).view(shapes[i][k]))  # type: ignore
        if fmt is None or not have:
            continue
        scales = torch.cat([recv[offsets[i, k] + n:offsets[i, k] + n + _SCALE_BYTES] for i, n in zip(have, numels)]
                           ).view(torch.float32)  # a copy: aligned
        if numels[0] and all(n == numels[0] for n in numels):
            values = torch.cat([recv[offsets[i, k]:offsets[i, k] + n] for i, n in zip(have, numels)]).view(fmt)
            back = _decoded(values.view(len(have), numels[0]), scales[:, None], fmt).to(dtype).unbind(0)
        else:
            back = [_decoded(recv[offsets[i, k]:offsets[i, k] + n].view(fmt), scales[m], fmt).to(dtype)
                    for m, (i, n) in enumerate(zip(have, numels))]
        for i, values in zip(have, back):
            out[i].append(values.view(shapes[i][k]))  # type: ignore[union-attr]
    return out


def exchange(rows: Sequence[Sequence[torch.Tensor]], recv_shapes: Sequence[Sequence[Sequence[int]]],
             formats: Sequence[torch.dtype | None], group: Any, rank: int) -> list[list[torch.Tensor]]:
    """Send ``rows[j]`` to rank ``j`` encoded in ``formats`` in ONE all-to-all; rank ``i``'s chunks come back
    decoded, shaped ``recv_shapes[i]``, in the dtype of the chunks sent. This rank's own row is kept exact."""
    dtype = rows[rank][0].dtype if rows[rank] else rows[0][0].dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    send, send_splits = encode(rows, formats, skip=rank)
    recv_splits = [0 if i == rank else wire_bytes(row, formats, itemsize) for i, row in enumerate(recv_shapes)]
    if torch.compiler.is_compiling():  # traced: the functional all-to-all of the same bytes (comm/traced.py)
        recv = collectives.traced_all_to_all_bytes(send, send_splits=send_splits, recv_splits=recv_splits,
                                                   group=group)
    else:
        recv = collectives._all_to_all_flat(send, send_splits, recv_splits, group)
    received = decode(recv, recv_shapes, formats, dtype, skip=rank)
    received[rank] = [chunk.reshape(shape) for chunk, shape in zip(rows[rank], recv_shapes[rank])]
    return received  # type: ignore[return-value]
