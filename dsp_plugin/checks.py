"""Cross-rank agreement before a collective: what every rank of a DSP group must share.

A collective whose ranks disagree on shapes, dtypes, dims or lengths does not
fail cleanly: gloo aborts the process (``EnforceNotMet``) or returns memory that
was never written, and a rank that raised on its own leaves its peers waiting for
the group timeout. So, before the collective, every rank encodes its call in a
small int64 *fingerprint* (:class:`CallFingerprint`), the group all-gathers the
fingerprints (``dsp_plugin.comm`` issues that collective; this module only
encodes and judges), and every rank judges the same table and raises the same
error — including a local error of one rank, whose message travels in its
fingerprint.

When (``DSP_CHECK`` in the environment, or :func:`set_check_mode`):

- ``1`` / ``always``: every call. One all-gather of ~0.5 KiB per rank and a host
  sync per primitive call.
- unset / ``first`` (default): the first call of each distinct signature in this
  process. A signature holds only what must be equal on every rank of a correct
  program (op, dtype, shape, dims, lengths, group), so all ranks decide alike and a
  static misconfiguration fails at the first step; a rank whose input *changes*
  mid-run while its peers' does not is caught by ``always`` only.
- ``0`` / ``off``: never (local argument errors are still raised).
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["CallFingerprint", "CrossRankMismatch", "InputMismatch", "check_mode", "decode_text", "describe_inputs",
           "describe_wire", "encode_text", "exchanging", "forget_signatures", "input_fingerprint", "input_words",
           "judge", "needs_check", "needs_check_for", "remember", "set_check_mode", "value_fingerprint", "wire_code"]

_MODES = {"1": "always", "always": "always", "": "first", "first": "first", "0": "off", "off": "off"}
_mode: str | None = None
_seen: set[tuple[object, ...]] = set()
_seen_lock = threading.Lock()
_SEEN_LIMIT = 4096

_OPS = ("split", "gather", "dynamic_switch", "to_heads", "from_heads", "replicate_grad")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 12
_MSG_BYTES = 320
_HEADER = ("op", "dtype", "ndim", "cur", "tgt", "global_len", "local_len", "group_size", "group_hash", "device",
           "replicated", "wire", "partial_grad")
LENGTH = 1 + len(_HEADER) + _MAX_DIMS + 1 + _MSG_BYTES // 8   # int64 words
_MAGIC = 0x44535031  # "DSP1"
MAGIC = _MAGIC
#: First word of the rows other agreements exchange in this format on a DSP group, and what a
#: rank sending one is doing instead of calling the primitive (named in the mismatch error).
GUARD_MAGIC = 0x44535047  # "DSPG": the DeepSpeed first-forward guard
PARAMS_MAGIC = 0x44535052  # "DSPR": reduce_gradients' parameter-list check
INPUTS_MAGIC = 0x44535049  # "DSPI": the entry check of a parallelized model's or a sampler's inputs
FAIL_MAGIC = 0x44535046  # "DSPF": one rank's error handed to every rank (comm.raise_together)
_FOREIGN = {GUARD_MAGIC: "finished the first forward without a DSP primitive and is in the DeepSpeed guard (is "
                         "the model DSP-aware on every rank?)",
            PARAMS_MAGIC: "is in reduce_gradients (its forward issued fewer DSP primitives)",
            INPUTS_MAGIC: "is checking the inputs of a parallelized model or a sampler (it entered another call)",
            FAIL_MAGIC: "is handing a rank's own error to every rank (a launch's check before its work)"}
FOREIGN = _FOREIGN


class CrossRankMismatch(ValueError):
    """The ranks of a group disagreed before a collective; raised alike on every rank."""


class InputMismatch(CrossRankMismatch):
    """The ranks of a DSP group were given different inputs (a parallelized model's, a sampler's)."""


def set_check_mode(mode: str | None) -> None:
    """``"always"``, ``"first"``, ``"off"`` (or ``"1"``, ``"0"``); ``None`` goes back to ``DSP_CHECK``."""
    global _mode
    if mode is not None and mode not in _MODES:
        raise ValueError(f"set_check_mode: mode={mode!r}; expected one of 'always', 'first', 'off'")
    _mode = None if mode is None else _MODES[mode]


_local = threading.local()


class exchanging:  # noqa: N801 - used as a context manager and a query
    """``with exchanging():`` marks the fingerprint all-gather; ``exchanging.active()`` is True inside.

    Accounting labels collectives issued inside as ``check``, so counts of a
    model's own traffic do not change with the check mode.
    """

    def __enter__(self) -> None:
        _local.active = True

    def __exit__(self, *exc: object) -> None:
        _local.active = False

    @staticmethod
    def active() -> bool:
        return getattr(_local, "active", False)


def forget_signatures() -> None:
    """Check the next call of every signature again (``first`` mode). Call it on every rank alike."""
    with _seen_lock:
        _seen.clear()


def check_mode() -> str:
    if _mode is not None:
        return _mode
    value = os.environ.get("DSP_CHECK", "").strip().lower()
    if value not in _MODES:
        raise ValueError(f"DSP_CHECK={value!r}; expected 1/always, 0/off, or unset/first")
    return _MODES[value]


def group_hash(ranks: Sequence[int]) -> int:
    return zlib.crc32(repr(list(ranks)).encode())


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _feed(digest: Any, value: object) -> None:
    if isinstance(value, torch.Tensor):
        # clone: an expanded size-1 tensor (``t.expand(1)``, a pipeline's timestep) counts as contiguous with
        # stride 0, which ``view(torch.uint8)`` refuses
        data = value.detach().reshape(-1).cpu().clone(memory_format=torch.contiguous_format)
        digest.update(f"T{data.dtype}{tuple(value.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    elif isinstance(value, torch.Generator):   # the stream it will draw: its state, not its identity
        digest.update(b"G" + value.get_state().numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}[".encode())
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif isinstance(value, dict):
        digest.update(f"dict{len(value)}{{".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
        digest.update(b"}")
    elif isinstance(value, _PLAIN):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    else:   # an object whose repr may hold an address: its type only
        digest.update(f"<{type(value).__qualname__}>;".encode())


def encode_text(text: str) -> list[int]:
    """``text`` (its first ``_MSG_BYTES`` UTF-8 bytes) as int64 words after its byte count."""
    raw = text.encode()[:_MSG_BYTES]
    padded = raw.ljust(_MSG_BYTES, b"\0")
    return [len(raw), *(int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, _MSG_BYTES, 8))]


def decode_text(words: Sequence[int]) -> str:
    """The inverse of ``encode_text``."""
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:1 + _MSG_BYTES // 8])
    return raw[:int(words[0])].decode(errors="replace")


def value_fingerprint(value: object) -> int:
    """A signed 64-bit hash of ``value``: tensors by dtype, shape and bytes; generators by state; containers
    recursively; plain values by repr; other objects by type. Equal on two ranks iff the inputs are alike.

    Bytes, not sums: a permuted input changes it, and identical inputs with NaN (or inf) hash alike.
    Costs one host copy of the tensors.
    """
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, value)
    return int.from_bytes(digest.digest(), "little", signed=True)


def input_fingerprint(args: Any, kwargs: Any) -> int:
    """The tensors of a call, in order (the DeepSpeed guard's first-forward fingerprint)."""
    return value_fingerprint([leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)])


def input_words(values: dict[str, object]) -> tuple[list[int], list[str]]:
    """``[INPUTS_MAGIC, count, one hash per argument ..]`` within a fingerprint's length, and the argument
    label of each hash (when there are more arguments than words, the last word hashes the rest)."""
    names = list(values)
    width = LENGTH - 2
    labels = names if len(names) <= width else names[:width - 1] + [", ".join(names[width - 1:])]
    hashes = [value_fingerprint(values[k]) for k in names[:len(labels) - 1]] if labels else []
    if labels:
        hashes.append(value_fingerprint([values[k] for k in names[len(labels) - 1:]]))
    return [INPUTS_MAGIC, len(names), *hashes], labels


def describe_inputs(name: str, rows: list[list[int]], ranks: Sequence[int], labels: Sequence[str],
                    hint: str) -> str | None:
    """The error for every rank's ``input_words`` (by group rank); None when the ranks agree."""
    if all(row == rows[0] for row in rows):
        return None
    differing = []
    for i, label in enumerate(labels):
        column = [row[2 + i] for row in rows]
        if any(v != column[0] for v in column):
            alike: dict[int, list[int]] = {}
            for r, v in zip(ranks, column):
                alike.setdefault(v, []).append(r)
            differing.append(f"{label} (alike on ranks {' | '.join(str(g) for g in alike.values())})")
    what = "; ".join(differing) or "the number of arguments"
    return (f"{name}: the inputs differ across the {len(ranks)} ranks of group {list(ranks)}: {what}. Expected the "
            f"same inputs on every rank of a DSP group (each rank takes its own shard of them). {hint}")


@dataclass(frozen=True)
class CallFingerprint:
    """One rank's view of a primitive call. ``shape`` has the sharded input dim's entry as -1."""

    op: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    cur: int          # sharded dim of the input, -1 if none (split)
    tgt: int          # sharded dim of the output, -1 if none (gather)
    global_len: int   # full length of `cur` as this rank knows it, -1 if unknown
    local_len: int    # this rank's length of `cur`, -1 if none
    group_size: int
    group_hash: int
    device: str
    error: str = ""   # this rank's own error, raised on every rank
    replicated: int = -1  # tokens every rank holds whole beside its shard (joint attention's text), -1 if none
    wire: int = 0     # the payload's wire format (``wire_code``): 0 is the activation's own dtype
    partial_grad: int = 0  # a gather's backward: 0 this rank's chunk, 1 a reduce-scatter (``partial_grad=True``)

    def signature(self) -> tuple[object, ...]:
        return (self.op, self.dtype, self.shape, self.cur, self.tgt, self.global_len, self.local_len,
                self.group_size, self.group_hash, self.device, self.replicated, self.wire, self.partial_grad)

    def encode(self) -> list[int]:
        msg = self.error.encode()[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else (-1 if self.dtype is None else 99)
        header = [_OPS.index(self.op), dtype, len(self.shape), self.cur, self.tgt, self.global_len,
                  self.local_len, self.group_size, self.group_hash, {"cpu": 0, "cuda": 1}.get(self.device, 2),
                  self.replicated, self.wire, self.partial_grad]
        shape = list(self.shape[:_MAX_DIMS]) + [-2] * (_MAX_DIMS - len(self.shape[:_MAX_DIMS]))
        words = [int.from_bytes(msg[i:i + 8], "little", signed=True) for i in range(0, _MSG_BYTES, 8)]
        return [_MAGIC, *header, *shape, len(self.error.encode()[:_MSG_BYTES]), *words]


_WIRE_DTYPES = (None, torch.float8_e4m3fn, torch.float8_e5m2)   # None: the activation's own dtype


def wire_code(forward: Sequence[torch.dtype | None], grad: Sequence[torch.dtype | None]) -> int:
    """A switch's wire format as one int: per tensor (at most 7), 2 bits of its forward format and 2 of its
    gradient's (``_WIRE_DTYPES``); ``0`` when everything travels in the activation's dtype. Ranks that disagree
    would send buffers of different sizes in the same all-to-all."""
    code = 0
    for i, (f, g) in enumerate(zip(forward, grad)):
        code |= (_WIRE_DTYPES.index(f) | _WIRE_DTYPES.index(g) << 2) << 4 * i
    return code


def describe_wire(code: int) -> str:
    """``wire_code`` in words: the activation's dtype, or the formats per tensor position (``exact``: its dtype)."""
    if code == 0:
        return "the activation's dtype (comm_dtype=None)"
    names = {None: "exact", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    parts = []
    for i in range(max(i for i in range(8) if code >> 4 * i & 15) + 1):   # up to the last tensor sent in FP8
        nibble = code >> 4 * i & 15
        parts.append(f"#{i} " + (f"{names[_WIRE_DTYPES[nibble & 3]]}/{names[_WIRE_DTYPES[nibble >> 2]]}"
                                  if nibble else "exact"))
    return "fp8 (tensor: forward/gradient; " + ", ".join(parts) + ")"


def _decode(words: Sequence[int]) -> dict[str, object]:
    header = dict(zip(_HEADER, words[1:1 + len(_HEADER)]))
    start = 1 + len(_HEADER)
    ndim = int(header["ndim"])
    shape = tuple(words[start:start + min(ndim, _MAX_DIMS)])
    msg_len = words[start + _MAX_DIMS]
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[start + _MAX_DIMS + 1:])
    dtype = header["dtype"]
    header["dtype"] = _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else ("other" if dtype == 99 else None)
    return {"magic": words[0], **header, "shape": shape, "error": raw[:msg_len].decode(errors="replace")}


def needs_check(fingerprint: CallFingerprint) -> bool:
    """Whether this call exchanges fingerprints (decided alike on every rank of a correct program)."""
    if fingerprint.error:
        return True
    return needs_check_for(fingerprint.signature())


def needs_check_for(key: tuple[object, ...]) -> bool:
    """``needs_check`` for any hashable signature (``comm.reduce_gradients`` checks its parameter list).

    A signature counts as seen only once its exchange agreed (``remember``), so
    after a mismatch every rank checks it again: no rank skips the check its
    peers make.
    """
    mode = check_mode()
    if mode == "always":
        return True
    if mode == "off":
        return False
    with _seen_lock:
        return key not in _seen


def remember(key: tuple[object, ...]) -> None:
    """Mark ``key`` as agreed by every rank (``first`` mode then skips its exchange)."""
    with _seen_lock:
        if len(_seen) >= _SEEN_LIMIT:
            _seen.clear()
        _seen.add(key)


def _describe(field: str, values: list[object], cur: int) -> str:
    by_rank = ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
    names = {"global_len": f"the full length of dim {cur} (global_len)", "cur": "the sharded input dim",
             "tgt": "the target dim", "shape": "the shape (sharded dim as -1)", "group_hash": "the group",
             "op": "the primitive", "local_len": "the local length",
             "replicated": "the count of replicated tokens (held whole by every rank beside its shard, e.g. the "
                           "text of joint attention)",
             "wire": "the wire format (comm_dtype; forward/gradient per tensor)",
             "partial_grad": "partial_grad (1: the backward reduce-scatters, 0: it keeps this rank's chunk)"}
    if field == "wire":
        by_rank = ", ".join(f"{describe_wire(int(v))} on rank {r}" for r, v in enumerate(values))  # type: ignore[arg-type]
    return f"{names.get(field, field)} is {by_rank}"


def judge(op: str, table: list[list[int]], ranks: Sequence[int], chunk_sizes) -> int:  # noqa: ANN001
    """Judge every rank's fingerprint; return the agreed full length of the input's sharded dim (-1 if none).

    ``table[r]`` is the fingerprint of group rank ``r``. Raises :class:`CrossRankMismatch`
    with the same message on every rank (the table is the same everywhere).
    """
    rows = [_decode(words) for words in table]
    where = f"{op}: the {len(rows)} ranks of group {list(ranks)}"
    if any(row["magic"] != _MAGIC for row in rows):
        known = "; ".join(f"rank {r} {_FOREIGN[row['magic']]}" for r, row in enumerate(rows)
                          if row["magic"] in _FOREIGN)
        raise CrossRankMismatch(f"{where} are not running the same primitive at this point "
                                f"(a rank entered another collective{': ' + known if known else ''}); "
                                f"expected every rank to call {op}")
    failed = [(r, row["error"]) for r, row in enumerate(rows) if row["error"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise CrossRankMismatch(f"{op}: rank(s) {[r for r, _ in failed]} of group {list(ranks)} rejected their "
                                f"input before the collective, so every rank stops here. {detail}")
    cur = int(rows[0]["cur"])
    for field in ("op", "group_hash", "group_size", "dtype", "device", "cur", "tgt", "replicated", "wire",
                  "partial_grad", "shape", "global_len"):
        values = [row[field] for row in rows]
        if any(v != values[0] for v in values):
            if field == "op":
                values = [_OPS[v] for v in values]  # type: ignore[index]
            raise CrossRankMismatch(f"{where} disagree before the collective: {_describe(field, values, cur)}; "
                                    f"expected the same on every rank")
    if cur < 0:
        return -1
    local = [int(row["local_len"]) for row in rows]
    total = int(rows[0]["global_len"])
    if total < 0:
        total = sum(local)
        if local != chunk_sizes(total, len(rows)):
            raise CrossRankMismatch(f"{op}: local lengths of dim {cur} across the group are {local}, "
                                    f"which is not a torch.tensor_split of {total} into {len(rows)}")
        return total
    expected = chunk_sizes(total, len(rows))
    wrong = [r for r in range(len(rows)) if local[r] != expected[r]]
    if wrong:
        r = wrong[0]
        raise CrossRankMismatch(f"{op}: rank {r} holds {local[r]} of dim {cur}, but global_len={total} "
                                f"split over {len(rows)} ranks gives it {expected[r]} "
                                f"(local lengths {local}, expected {expected})")
    return total
