"""A call's arguments checked, and the same call agreed by every rank of the group before its collective.

Before a collective the ranks may compare fingerprints of the call
(``dsp_plugin.checks``; ``DSP_CHECK=1`` always, by default the first call of
each signature), so a disagreement raises the same clear error on every rank
instead of aborting gloo or returning garbage. A rank's own argument error goes
through that exchange too, so its peers stop with it. The exchange is one small
all_gather (``dsp_plugin.comm.collectives``).
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.distributed as dist

from dsp_plugin import checks
from dsp_plugin.comm.collectives import _all_gather_tensor, released
from dsp_plugin.packing import chunk_sizes

__all__ = ["agree_inputs", "exchange_words", "raise_together"]


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
    rows = table.view(n, -1).tolist()
    refs = [weakref.ref(table), weakref.ref(mine)]
    del table, mine
    released(group, refs)   # an error raised next may end the process: leave gloo holding nothing
    return rows


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
    backend = dist.get_backend(group)  # torch's fake backend stands in for NCCL where CUDA is (backend.py)
    if backend == "nccl" or (backend == "fake" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(name: str, x: object, *, cur: int, tgt: int, known_len: int | None, group: dist.ProcessGroup,
           n: int, rank: int, error: Exception | None, replicated: int = -1, wire: int = 0,
           partial_grad: bool = False) -> int:
    """Agree with the group before the collective; return the full length of dim ``cur`` (-1 if none).

    ``error`` is this rank's own argument error: it is raised after the
    exchange, on every rank alike, so no peer is left waiting in a collective.
    ``replicated``: tokens the call carries whole on every rank beside the shard
    (the head switch's joint attention), compared across ranks; ``wire``: the payload's format
    (``checks.wire_code``), compared too (an FP8 rank and a bf16 rank would send buffers of different
    sizes in the same all-to-all); ``partial_grad``: a gather's backward (a reduce-scatter or none), compared
    too (a rank that reduce-scatters in backward would wait for peers that do not). Without a check
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
        error="" if error is None else f"{type(error).__name__}: {error}", replicated=replicated, wire=wire,
        partial_grad=int(partial_grad))
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


def agree_inputs(name: str, values: dict[str, object], *, group: dist.ProcessGroup | None, hint: str,
                 every_call: bool = False) -> None:
    """Every rank of ``group`` was given the same ``values`` (an entry's arguments by name), else
    ``checks.InputMismatch`` on every rank, naming the arguments that differ and which ranks hold alike ones.

    The entry check of a parallelized model's forward and of the samplers: an unseeded ``torch.randn``,
    a prompt, seed, generator or latents that differ per rank would otherwise mix a sample from several
    inputs without a word. Run when ``checks`` says so: by default the first call of each signature (the
    arguments' names, shapes and dtypes), every call under ``DSP_CHECK=1``, never under ``DSP_CHECK=0``;
    ``every_call=True`` (the samplers: a prompt changes from call to call, and a call takes seconds) on
    every call unless ``DSP_CHECK=0``. One all_gather of a fingerprint row (the primitives' check format)
    and a host copy of the inputs.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    n = dist.get_world_size(group)
    if n == 1:
        return
    ranks = dist.get_process_group_ranks(group)
    key = ("inputs", name, tuple(ranks), tuple((k, _structure(v)) for k, v in values.items()))
    if not (checks.check_mode() != "off" if every_call else checks.needs_check_for(key)):
        return
    words, labels = checks.input_words(values)
    # the group's device, not an input's: a CPU input (a timestep, a generator's state) under NCCL is refused
    table = exchange_words(words, group=group, device=_exchange_device(None, group))
    foreign = [r for r, row in zip(ranks, table) if row[0] != checks.INPUTS_MAGIC]
    if foreign:
        known = "".join(f"; rank {r} {checks.FOREIGN[row[0]]}" for r, row in zip(ranks, table)
                        if row[0] in checks.FOREIGN and row[0] != checks.INPUTS_MAGIC)
        raise checks.CrossRankMismatch(f"{name}: rank(s) {foreign} of group {ranks} are in another collective "
                                       f"(a DSP primitive or a check) while the others check their inputs{known}; "
                                       f"expected every rank to call {name} here")
    message = checks.describe_inputs(name, [row[:len(words)] for row in table], ranks, labels, hint)
    if message is not None:
        raise checks.InputMismatch(message)
    checks.remember(key)


def _structure(value: object) -> object:
    """What must be alike in a correct program, cheaply: shapes and dtypes of tensors, containers' layout."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_structure(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _structure(v)) for k, v in value.items())
    return type(value).__name__


def raise_together(name: str, error: Exception | None, *, group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` raises the first failing rank's error (``error``: this rank's, or None).

    For a check only some ranks can make (the writing rank's output path): one all_gather of a row
    with the message, so a rank without an error raises ``CrossRankMismatch`` carrying the failing
    rank's text, and the failing rank its own error, instead of its peers waiting in their next
    collective. Costs one small collective, always (a preflight, once).
    """
    words = [checks.FAIL_MAGIC, *checks.encode_text("" if error is None else f"{type(error).__name__}: {error}")]
    table = exchange_words(words, group=group, device=_exchange_device(None, group))
    ranks = dist.get_process_group_ranks(group)
    failed = [(r, checks.decode_text(row[1:])) for r, row in zip(ranks, table)
              if row[0] == checks.FAIL_MAGIC and row[1]]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise checks.CrossRankMismatch(f"{name}: rank {rank} failed its own check before the work, so every rank "
                                       f"stops here: {message}")
