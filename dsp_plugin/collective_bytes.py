"""Bytes each rank sends and receives per collective operator, by the convention of the paper's Table 3.

``OPS`` maps every ``c10d::*`` and ``_c10d_functional::*`` operator that moves data to the op
name ``CommAccounting`` records and a counter over the operator's arguments by schema name
(``dsp_plugin.accounting`` binds them). Sizes are logical, per rank: an all-to-all counts what
leaves the rank (not the block it keeps), a ring all-reduce ``2 * bytes * (N - 1) / N``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["NAMESPACES", "OPS"]


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
OPS: dict[str, tuple[str, Callable[..., tuple[int, int]]]] = {
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
    OPS.update({
        f"{_ns}.all_to_all_single": ("all_to_all", _all_to_all_single),
        f"{_ns}.all_gather_into_tensor": ("all_gather", _all_gather("input")),
        f"{_ns}.reduce_scatter_tensor": ("reduce_scatter", _reduce_scatter("input")),
    })
OPS.update({
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
NAMESPACES = frozenset(key.partition(".")[0] for key in OPS)
