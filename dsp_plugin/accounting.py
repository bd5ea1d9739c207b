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

Bytes are per rank and logical, the convention of the paper's Table 3 (counters in
``dsp_plugin.collective_bytes``):

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

The cross-rank fingerprint exchange of ``dsp_plugin.checks`` (``checks.exchanging()``) is
recorded with ``phase="check"`` in ``check_records``, not in ``records``, so a model's counts
and bytes do not change with the check mode.

Each record names its group by the global ranks in it (``group_ranks``) and by
``group_name``, not only by its size.

Saved activations are measured with ``torch.autograd.graph.saved_tensors_hooks``:
the bytes of every distinct storage that autograd saves for backward inside the
block, leaves (parameters, inputs) excluded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsp_plugin.checks import exchanging
from dsp_plugin.collective_bytes import NAMESPACES, OPS
from dsp_plugin.layout import storage_address

__all__ = ["CollectiveRecord", "CommAccounting"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by this rank."""

    op: str
    bytes_sent: int
    bytes_received: int
    group_size: int
    phase: str  # "forward", "backward" (inside autograd's backward pass) or "check" (dsp_plugin.checks)
    group_ranks: tuple[int, ...] = ()  # global ranks of the group, in group-rank order
    group_name: str = ""
    source: str = ""  # the dispatcher operator, e.g. "c10d.allreduce_" or "_c10d_functional.all_reduce"


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
        if getattr(func, "namespace", None) in NAMESPACES:
            key = f"{func.namespace}.{func._schema.name.partition('::')[2]}"
            if key in OPS:
                record = self._record(key, func, args, kwargs)
                (self.owner.check_records if record.phase == "check" else self.owner.records).append(record)
        return func(*args, **kwargs)

    @staticmethod
    def _record(key: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveRecord:
        op, count = OPS[key]
        bound = _bind(func, args, kwargs)
        pg = _group(bound)
        n, rank = pg.size(), pg.rank()
        try:
            sent, received = count(bound, n, rank)
        except Exception:  # noqa: BLE001 - an argument form we do not parse: still count the call
            sent, received = -1, -1
        if exchanging.active():  # dsp_plugin.checks' fingerprint exchange, not the model's traffic
            phase = "check"
        else:
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
        self.check_records: list[CollectiveRecord] = []  # dsp_plugin.checks' exchanges, kept apart
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
            address = storage_address(t)  # fake tensors (dsp_plugin.dryrun) share data pointer 0
            if address not in self._storages:
                self._storages.add(address)
                self.saved_activation_bytes += t.untyped_storage().nbytes()
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
