"""Count every collective and every saved-for-backward byte inside a ``with`` block.

Collectives are caught where all of torch.distributed's Python API ends: the
methods of ``ProcessGroup`` (``group.all_to_all_single(...)``,
``group.all_gather_single(...)``, ...). Patching there rather than the
``torch.distributed`` functions also catches libraries that bound those
functions early (DeepSpeed keeps ``all_gather_into_tensor`` in an attribute),
so DSP, DeepSpeed, Megatron and our baselines are all measured the same way.
Functional collectives (``torch.distributed._functional_collectives``) do not
pass through these methods and are not counted.

Bytes are per rank and logical, the convention of the paper's Table 3:

==================  =========================================  ===================
op                  bytes_sent                                 bytes_received
==================  =========================================  ===================
all_to_all          input minus the block kept by this rank    output minus it
all_gather          input * (N - 1)                            output - input
reduce_scatter      input - output                             input - output
all_reduce          2 * bytes * (N - 1) / N  (ring)            same
broadcast, send     the tensor's bytes (sender)                (receivers)
==================  =========================================  ===================

Saved activations are measured with ``torch.autograd.graph.saved_tensors_hooks``:
the bytes of every distinct storage that autograd saves for backward inside the
block, leaves (parameters, inputs) excluded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup

__all__ = ["CollectiveRecord", "CommAccounting"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by this rank."""

    op: str
    bytes_sent: int
    bytes_received: int
    group_size: int
    phase: str  # "forward" or "backward" (inside autograd's backward pass)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _alltoall_single(pg: ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                     output_splits: list[int] | None = None, input_splits: list[int] | None = None,
                     *_: Any) -> tuple[int, int]:
    n, rank = pg.size(), pg.rank()
    row_in = _nbytes(input) // max(input.shape[0], 1) if input.dim() else 0
    row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else 0
    in_splits = list(input_splits or []) or [input.shape[0] // n] * n
    out_splits = list(output_splits or []) or [output.shape[0] // n] * n
    return _nbytes(input) - in_splits[rank] * row_in, _nbytes(output) - out_splits[rank] * row_out


def _alltoall_list(pg: ProcessGroup, outputs: list, inputs: list, *_: Any) -> tuple[int, int]:
    rank = pg.rank()
    return _nbytes(inputs) - _nbytes(inputs[rank]), _nbytes(outputs) - _nbytes(outputs[rank])


def _allgather(pg: ProcessGroup, output: Any, input: Any, *_: Any) -> tuple[int, int]:
    sent = _nbytes(input)
    return sent * (pg.size() - 1), _nbytes(output) - sent


def _reduce_scatter(pg: ProcessGroup, output: Any, input: Any, *_: Any) -> tuple[int, int]:
    moved = _nbytes(input) - _nbytes(output)
    return moved, moved


def _allreduce(pg: ProcessGroup, tensors: Any, *_: Any) -> tuple[int, int]:
    n = pg.size()
    moved = 2 * _nbytes(tensors) * (n - 1) // n
    return moved, moved


def _rooted(pg: ProcessGroup, tensors: Any, opts: Any = None, *_: Any) -> tuple[int, int]:
    size = _nbytes(tensors)
    root = getattr(opts, "rootRank", 0)
    return (size, 0) if pg.rank() == root else (0, size)


def _send(pg: ProcessGroup, tensors: Any, *_: Any) -> tuple[int, int]:
    return _nbytes(tensors), 0


def _recv(pg: ProcessGroup, tensors: Any, *_: Any) -> tuple[int, int]:
    return 0, _nbytes(tensors)


def _nothing(pg: ProcessGroup, *_: Any, **__: Any) -> tuple[int, int]:
    return 0, 0


#: ProcessGroup method -> (op name in records, byte counter)
_METHODS: dict[str, tuple[str, Callable[..., tuple[int, int]]]] = {
    "all_to_all_single": ("all_to_all", _alltoall_single),
    "alltoall_base": ("all_to_all", _alltoall_single),
    "alltoall": ("all_to_all", _alltoall_list),
    "all_gather_single": ("all_gather", _allgather),
    "_allgather_base": ("all_gather", _allgather),
    "allgather": ("all_gather", _allgather),
    "allgather_coalesced": ("all_gather", _allgather),
    "allgather_into_tensor_coalesced": ("all_gather", _allgather),
    "all_gather_single_coalesced": ("all_gather", _allgather),
    "reduce_scatter_single": ("reduce_scatter", _reduce_scatter),
    "_reduce_scatter_base": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_single_coalesced": ("reduce_scatter", _reduce_scatter),
    "allreduce": ("all_reduce", _allreduce),
    "allreduce_coalesced": ("all_reduce", _allreduce),
    "broadcast": ("broadcast", _rooted),
    "reduce": ("reduce", _rooted),
    "gather": ("gather", _rooted),
    "scatter": ("scatter", _rooted),
    "send": ("send", _send),
    "recv": ("recv", _recv),
    "recv_anysource": ("recv", _recv),
    "barrier": ("barrier", _nothing),
}

_lock = threading.Lock()
_active: list[CommAccounting] = []
_originals: dict[str, Callable[..., Any]] = {}
_local = threading.local()


def _wrap(method: str, op: str, count: Callable[..., tuple[int, int]]) -> Callable[..., Any]:
    original = getattr(ProcessGroup, method)

    def wrapper(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0) == 0 and _active:
            try:
                sent, received = count(self, *args, **kwargs)
            except Exception:  # an overload we do not parse: still count the call
                sent, received = -1, -1
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            record = CollectiveRecord(op, sent, received, self.size(), phase)
            for acct in _active:
                acct.records.append(record)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.depth -= 1

    return wrapper


class CommAccounting:
    """Context manager recording collectives and saved-activation bytes on this rank.

    >>> with CommAccounting() as acct:
    ...     y = model(x); y.sum().backward()
    >>> acct.count("all_to_all", phase="forward"), acct.bytes_sent("all_to_all")
    """

    def __init__(self, *, activations: bool = True) -> None:
        self.records: list[CollectiveRecord] = []
        self.saved_activation_bytes = 0
        self._storages: set[int] = set()
        self._activations = activations
        self._hooks: Any = None

    # -- collectives -------------------------------------------------------
    def __enter__(self) -> CommAccounting:
        with _lock:
            if not _active:
                for method, (op, count) in _METHODS.items():
                    if method in vars(ProcessGroup):
                        # keep the raw descriptor: getattr would hand back pybind's unbound
                        # function, which no longer binds `self` once set on the class again
                        _originals[method] = vars(ProcessGroup)[method]
                        setattr(ProcessGroup, method, _wrap(method, op, count))
            _active.append(self)
        if self._activations:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        with _lock:
            _active.remove(self)
            if not _active:
                for method, original in _originals.items():
                    setattr(ProcessGroup, method, original)
                _originals.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._storages:
                self._storages.add(storage.data_ptr())
                self.saved_activation_bytes += storage.nbytes()
        return t

    # -- queries -----------------------------------------------------------
    def select(self, op: str | None = None, phase: str | None = None) -> list[CollectiveRecord]:
        return [r for r in self.records if (op is None or r.op == op) and (phase is None or r.phase == phase)]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))

    def bytes_sent(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes_sent for r in self.select(op, phase))

    def bytes_received(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes_received for r in self.select(op, phase))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_to_all/forward": {"count": 3, "bytes_sent": ..., "bytes_received": ...}, ...}``."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            row = out.setdefault(f"{r.op}/{r.phase}", {"count": 0, "bytes_sent": 0, "bytes_received": 0})
            row["count"] += 1
            row["bytes_sent"] += r.bytes_sent
            row["bytes_received"] += r.bytes_received
        return out
