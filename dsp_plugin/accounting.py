"""Count every collective and every saved-for-backward byte inside a ``with`` block.

Collectives are caught at the dispatcher, with a ``TorchDispatchMode``: every
``torch.distributed`` call, every ``ProcessGroup`` method and every C++ caller
(DDP's reducer, which all-reduces gradient buckets from C++) ends in one of the
``c10d::*`` operators (``ProcessGroup.hpp`` dispatches them), and functional
collectives (``torch.distributed._functional_collectives``) are the
``_c10d_functional::*`` operators. Each is recorded once, where it enters the
dispatcher, so DSP, DeepSpeed, Megatron, torch DDP and our baselines are all
measured the same way, and nothing in torch is patched. (torch's own
``CommDebugMode`` is the same idea but counts calls only: no bytes, no group.)

A dispatch mode is per thread and follows autograd into its engine threads;
collectives that another thread issues on its own (not through autograd) are not
seen. Every op inside the block passes through the mode, which costs a few
microseconds per op: measure time outside the block.

Bytes are per rank and logical, the convention of the paper's Table 3:

==================  =========================================  ===================
op                  bytes_sent                                 bytes_received
==================  =========================================  ===================
all_to_all          input minus the block kept by this rank    output minus it
all_gather          input * (N - 1)                            output - input
reduce_scatter      input - output                             input - output
all_reduce          2 * bytes * (N - 1) / N  (ring)            same
broadcast           the tensor's bytes (root)                  (the other ranks)
reduce              the tensor's bytes (non-root ranks)        (N - 1) * bytes (root)
gather, scatter     what leaves this rank                      what arrives
send, recv          the tensor's bytes (sender)                (receiver)
==================  =========================================  ===================

Each record names its group by the global ranks in it (``group_ranks``) and by
``group_name``, not only by its size.

Saved activations are measured with ``torch.autograd.graph.saved_tensors_hooks``:
the bytes of every distinct storage that autograd saves for backward inside the
block, leaves (parameters, inputs) excluded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecord", "CommAccounting"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by this rank."""

    op: str
    bytes_sent: int
    bytes_received: int
    group_size: int
    phase: str  # "forward" or "backward" (inside autograd's backward pass)
    group_ranks: tuple[int, ...] = ()  # global ranks of the group, in group-rank order
    group_name: str = ""
    source: str = ""  # the dispatcher operator, e.g. "c10d.allreduce_" or "_c10d_functional.all_reduce"


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _row_bytes(t: torch.Tensor) -> int:
    return _nbytes(t) // t.shape[0] if t.dim() and t.shape[0] else 0


def _all_to_all_single(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    """``input`` (and c10d's ``output``) along dim 0; empty split sizes mean equal chunks."""
    inp = a["input"]
    row = _row_bytes(inp)
    in_splits = list(a["input_split_sizes"] or []) or [inp.shape[0] // n] * n
    sent = _nbytes(inp) - in_splits[rank] * row
    if "output" in a:  # c10d.alltoall_base_ writes into a given tensor
        out = a["output"]
        out_splits = list(a["output_split_sizes"] or []) or [out.shape[0] // n] * n
        return sent, _nbytes(out) - out_splits[rank] * _row_bytes(out)
    out_splits = list(a["output_split_sizes"] or []) or in_splits  # functional: allocates the output
    return sent, (sum(out_splits) - out_splits[rank]) * row


def _all_to_all_list(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    outs, ins = a["output_tensors"], a["input_tensors"]
    return _nbytes(ins) - _nbytes(ins[rank]), _nbytes(outs) - _nbytes(outs[rank])


def _all_gather(inputs: str, outputs: str | None = None) -> Callable[..., tuple[int, int]]:
    def count(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
        sent = _nbytes(a[inputs])
        received = _nbytes(a[outputs]) - sent if outputs else sent * (n - 1)
        return sent * (n - 1), received
    return count


def _reduce_scatter(inputs: str, outputs: str | None = None) -> Callable[..., tuple[int, int]]:
    def count(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
        size = _nbytes(a[inputs])
        moved = size - (_nbytes(a[outputs]) if outputs else size // n)
        return moved, moved
    return count


def _all_reduce(key: str) -> Callable[..., tuple[int, int]]:
    def count(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
        moved = 2 * _nbytes(a[key]) * (n - 1) // n
        return moved, moved
    return count


def _broadcast(key: str, root: str) -> Callable[..., tuple[int, int]]:
    def count(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
        size = _nbytes(a[key])
        return (size, 0) if rank == a[root] else (0, size)
    return count


def _reduce(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    size = _nbytes(a["tensors"])
    return (0, size * (n - 1)) if rank == a["root_rank"] else (size, 0)


def _gather(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    own = _nbytes(a["input_tensors"])
    return (0, _nbytes(a["output_tensors"]) - own) if rank == a["root_rank"] else (own, 0)


def _scatter(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    own = _nbytes(a["output_tensors"])
    return (_nbytes(a["input_tensors"]) - own, 0) if rank == a["root_rank"] else (0, own)


def _p2p(key: str, sending: bool) -> Callable[..., tuple[int, int]]:
    def count(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
        size = _nbytes(a[key])
        return (size, 0) if sending else (0, size)
    return count


def _batch_p2p(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    sent = sum(_nbytes(t) for op, t in zip(a["op_list"], a["tensors"]) if "send" in op)
    return sent, _nbytes(a["tensors"]) - sent


def _nothing(a: dict[str, Any], n: int, rank: int) -> tuple[int, int]:
    return 0, 0


#: "namespace.operator" -> (op name in records, byte counter over the schema's named arguments)
_OPS: dict[str, tuple[str, Callable[..., tuple[int, int]]]] = {
    "c10d.alltoall_base_": ("all_to_all", _all_to_all_single),
    "c10d.alltoall_": ("all_to_all", _all_to_all_list),
    "c10d._allgather_base_": ("all_gather", _all_gather("input_tensor", "output_tensor")),
    "c10d.allgather_": ("all_gather", _all_gather("input_tensors", "output_tensors")),
    "c10d.allgather_coalesced_": ("all_gather", _all_gather("input_list", "output_lists")),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", _all_gather("inputs", "outputs")),
    "c10d._reduce_scatter_base_": ("reduce_scatter", _reduce_scatter("input_tensor", "output_tensor")),
    "c10d.reduce_scatter_": ("reduce_scatter", _reduce_scatter("input_tensors", "output_tensors")),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", _reduce_scatter("inputs", "outputs")),
    "c10d.allreduce_": ("all_reduce", _all_reduce("tensors")),
    "c10d.allreduce_coalesced_": ("all_reduce", _all_reduce("tensors")),
    "c10d.broadcast_": ("broadcast", _broadcast("tensors", "root_rank")),
    "c10d.reduce_": ("reduce", _reduce),
    "c10d.gather_": ("gather", _gather),
    "c10d.scatter_": ("scatter", _scatter),
    "c10d.send": ("send", _p2p("tensors", True)),
    "c10d.recv_": ("recv", _p2p("tensors", False)),
    "c10d.recv_any_source_": ("recv", _p2p("tensors", False)),
    "c10d.barrier": ("barrier", _nothing),
    "c10d.monitored_barrier_": ("barrier", _nothing),
}
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    _OPS.update({
        f"{_ns}.all_to_all_single": ("all_to_all", _all_to_all_single),
        f"{_ns}.all_gather_into_tensor": ("all_gather", _all_gather("input")),
        f"{_ns}.reduce_scatter_tensor": ("reduce_scatter", _reduce_scatter("input")),
    })
_OPS.update({
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", _all_gather("input")),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", _all_gather("inputs")),
    "_c10d_functional.reduce_scatter_tensor_out": ("reduce_scatter", _reduce_scatter("input")),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", _reduce_scatter("inputs")),
    "_c10d_functional.all_reduce": ("all_reduce", _all_reduce("input")),
    "_c10d_functional.all_reduce_": ("all_reduce", _all_reduce("input")),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", _all_reduce("inputs")),
    "_c10d_functional.all_reduce_coalesced_": ("all_reduce", _all_reduce("inputs")),
    "_c10d_functional.broadcast": ("broadcast", _broadcast("input", "src")),
    "_c10d_functional.broadcast_": ("broadcast", _broadcast("input", "src")),
    "_c10d_functional.isend": ("send", _p2p("tensor", True)),
    "_c10d_functional.irecv": ("recv", _p2p("tensor", False)),
    "_c10d_functional.batch_p2p_ops": ("send/recv", _batch_p2p),
})
_NAMESPACES = frozenset(key.partition(".")[0] for key in _OPS)


def _bind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The operator's arguments by schema name (defaults filled in)."""
    bound = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name not in bound and arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _group(bound: dict[str, Any]) -> Any:
    """The ProcessGroup of a c10d operator (a boxed ScriptObject) or of a functional one (its name)."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    if "process_group" in bound:
        return ProcessGroup.unbox(bound["process_group"])
    return _resolve_process_group(bound["group_name"])


def _ranks(pg: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(pg))
    except (ValueError, KeyError, RuntimeError):  # a group torch.distributed did not register
        return ()


class _Recorder(TorchDispatchMode):
    """The dispatch mode: records the collectives that reach the dispatcher, then runs them unchanged."""

    def __init__(self, owner: CommAccounting) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in _NAMESPACES:
            key = f"{func.namespace}.{func._schema.name.partition('::')[2]}"
            if key in _OPS:
                self.owner.records.append(self._record(key, func, args, kwargs))
        return func(*args, **kwargs)

    @staticmethod
    def _record(key: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveRecord:
        op, count = _OPS[key]
        bound = _bind(func, args, kwargs)
        pg = _group(bound)
        n, rank = pg.size(), pg.rank()
        try:
            sent, received = count(bound, n, rank)
        except Exception:  # noqa: BLE001 - an argument form we do not parse: still count the call
            sent, received = -1, -1
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return CollectiveRecord(op, sent, received, n, phase, _ranks(pg), pg.group_name, key)


class CommAccounting:
    """Context manager recording collectives and saved-activation bytes on this rank.

    >>> with CommAccounting() as acct:
    ...     y = model(x); y.sum().backward()
    >>> acct.count("all_to_all", phase="forward"), acct.bytes_sent("all_to_all")

    Blocks nest: each records everything issued inside it.
    """

    def __init__(self, *, activations: bool = True) -> None:
        self.records: list[CollectiveRecord] = []
        self.saved_activation_bytes = 0
        self._storages: set[int] = set()
        self._activations = activations
        self._hooks: Any = None
        self._mode: _Recorder | None = None

    # -- collectives -------------------------------------------------------
    def __enter__(self) -> CommAccounting:
        self._mode = _Recorder(self)
        self._mode.__enter__()
        if self._activations:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._storages:
                self._storages.add(storage.data_ptr())
                self.saved_activation_bytes += storage.nbytes()
        return t

    # -- queries -----------------------------------------------------------
    def select(self, op: str | None = None, phase: str | None = None,
               group: Any = None) -> list[CollectiveRecord]:
        """Records matching ``op``, ``phase`` and ``group`` (a ProcessGroup or its global ranks)."""
        ranks = None if group is None else tuple(group) if isinstance(group, (list, tuple)) else _ranks(group)
        return [r for r in self.records if (op is None or r.op == op) and (phase is None or r.phase == phase)
                and (ranks is None or r.group_ranks == ranks)]

    def count(self, op: str | None = None, phase: str | None = None, group: Any = None) -> int:
        return len(self.select(op, phase, group))

    def bytes_sent(self, op: str | None = None, phase: str | None = None, group: Any = None) -> int:
        return sum(r.bytes_sent for r in self.select(op, phase, group))

    def bytes_received(self, op: str | None = None, phase: str | None = None, group: Any = None) -> int:
        return sum(r.bytes_received for r in self.select(op, phase, group))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_to_all/forward": {"count": 3, "bytes_sent": ..., "bytes_received": ...}, ...}``."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            row = out.setdefault(f"{r.op}/{r.phase}", {"count": 0, "bytes_sent": 0, "bytes_received": 0})
            row["count"] += 1
            row["bytes_sent"] += r.bytes_sent
            row["bytes_received"] += r.bytes_received
        return out

    def by_group(self) -> dict[tuple[int, ...], dict[str, int]]:
        """``{group ranks: {"count", "bytes_sent", "bytes_received"}}``: which group carried the traffic."""
        out: dict[tuple[int, ...], dict[str, int]] = {}
        for r in self.records:
            row = out.setdefault(r.group_ranks, {"count": 0, "bytes_sent": 0, "bytes_received": 0})
            row["count"] += 1
            row["bytes_sent"] += r.bytes_sent
            row["bytes_received"] += r.bytes_received
        return out
