"""The wire format of an all-to-all's payload: the activation's own dtype, or FP8 with a scale per chunk.

``comm_dtype="fp8"`` (a switch's, a head switch's, a plan's option) sends each
chunk -- one tensor's block for one destination rank -- as FP8 bytes followed by
its scale (4 bytes, float32), all in the same ``all_to_all_single`` of one flat
``uint8`` buffer, and casts back to the activation's dtype after the receive.
The scale is ``amax(|chunk|) / max(format)``, computed on the device (no host
sync). A chunk of ``e`` elements of a 2-byte activation therefore costs ``e + 4``
bytes instead of ``2 e``: per rank and per tensor, ``(bf16 bytes) / 2 + 4 (N - 1)``,
what ``CommAccounting`` reports, since it counts the ``uint8`` buffer actually sent.
The block a rank keeps for itself never travels, so it is kept exact.

Formats (``Payload``): forward ``float8_e4m3fn`` (3 mantissa bits, range 448);
backward ``float8_e4m3fn`` too. The usual argument for ``e5m2`` in backward
(Transformer Engine's "hybrid" recipe) is the gradients' dynamic range under a
per-*tensor* scale; here every chunk has its own scale, so a chunk must hold only
its own range, and the extra mantissa bit halves the rounding error. Measured on
the tiny STDiT's and Wan's backward switches (``tests/test_fp8_loss_parity.py``
prints it): mean relative round-trip error 0.022 / 0.025 in e4m3 against
0.034 / 0.052 in e5m2, and no element flushed to zero in either.
``Payload(grad=torch.float8_e5m2)`` selects e5m2 for a model whose gradient
chunks span more than e4m3's ~2^17.

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


def _round_trip(chunk: torch.Tensor, wire: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> dict[str, Any]:
    original = chunk.float()
    back = wire.float() * scale
    norm = original.norm().item()
    nonzero = original != 0
    return {"format": str(fmt).removeprefix("torch."), "backward": torch._C._current_graph_task_id() != -1,
            "rel_error": (back - original).norm().item() / norm if norm else 0.0,
            "flushed": ((back == 0) & nonzero).sum().item() / max(int(nonzero.sum().item()), 1)}


def encode(rows: Sequence[Sequence[torch.Tensor]], formats: Sequence[torch.dtype | None], *, skip: int = -1
           ) -> tuple[torch.Tensor, list[int]]:
    """``rows[j]``: the chunks for rank ``j``, one per tensor -> (one flat uint8 buffer, bytes per rank).

    Chunk ``k`` is ``formats[k]`` bytes then its float32 scale, or (None) the raw bytes of its dtype.
    Row ``skip`` (this rank's own) is left out: it does not travel.
    """
    parts: list[torch.Tensor] = []
    splits: list[int] = []
    for j, row in enumerate(rows):
        size = 0
        for chunk, fmt in zip(row, formats):
            if j == skip:
                break
            flat = chunk.reshape(-1)
            if fmt is None:
                part = flat.contiguous().view(torch.uint8)
                parts.append(part)
                size += part.numel()
                continue
            top = torch.finfo(fmt).max
            # [1], stride 1: Inductor (torch 2.11 on CUDA) fails to bitcast a 0-dim value reshaped to [1]
            # ("self.stride(-1) must be 1 to view Float as Byte ... but got 0")
            amax = flat.abs().amax(0, keepdim=True).float() if flat.numel() else flat.new_zeros(1, dtype=torch.float32)
            scale = (amax / top).clamp_min(torch.finfo(torch.float32).tiny)  # a zero chunk: any scale will do
            wire = (flat.float() / scale).clamp(-top, top).to(fmt)
            if _measured is not None:
                _measured.append(_round_trip(flat, wire, scale, fmt))
            parts.append(wire.view(torch.uint8))
            parts.append(scale.view(torch.uint8))
            size += flat.numel() + _SCALE_BYTES
        splits.append(size)
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=rows[0][0].device), splits
    return torch.cat(parts), splits


def decode(recv: torch.Tensor, shapes: Sequence[Sequence[Sequence[int]]], formats: Sequence[torch.dtype | None],
           dtype: torch.dtype, *, skip: int = -1) -> list[list[torch.Tensor] | None]:
    """The inverse of ``encode`` on the receive side: rank ``i``'s chunks, shaped ``shapes[i][k]``, in ``dtype``
    (row ``skip``: None, it did not travel). Byte offsets need not be aligned: scales and raw chunks are copied."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out: list[list[torch.Tensor] | None] = []
    start = 0
    for i, row in enumerate(shapes):
        if i == skip:
            out.append(None)
            continue
        chunks = []
        for shape, fmt in zip(row, formats):
            numel = math.prod(shape)
            if fmt is None:
                nbytes = numel * itemsize
                chunks.append(recv[start:start + nbytes].clone().view(dtype).view(shape))
                start += nbytes
                continue
            values = recv[start:start + numel].view(fmt)
            scale = recv[start + numel:start + numel + _SCALE_BYTES].clone().view(torch.float32)
            chunks.append((values.float() * scale).to(dtype).view(shape))
            start += numel + _SCALE_BYTES
        out.append(chunks)
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
