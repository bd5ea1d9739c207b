"""The data movement a plan applies, on tensors described by a ``Layout`` and a global grid.

A tensor in layout ``"(B T) S D"`` sharded on T is viewed with every axis
separate (``[B, T_local, S, D]``), moved by the primitives of ``dsp_plugin.comm``
along the axis index, and folded back. The shard is tagged with the one carrier,
``layout.ShardSpec(dim, global_len, grid, axis)``, so a later hook (or a
recompute under activation checkpointing) reads every global length from it.

Gradient convention (the project's): each rank's gradient is its partial sum
and the full gradient is the sum over the DSP group. So a split of a replicated
activation inside the model has the *partial* adjoint (its own chunk, zeros
elsewhere; no communication), and a gather, whose output feeds a computation
that every rank repeats, is paired with a 1/N on the model's replicated outputs
and an N on the gather's backward, so parameters used after the gather get 1/N
of the gradient on each rank. A gather whose output feeds work each rank does on
its own shard (``Gather(partial_grad=True)``) gets a partial gradient on each rank
instead: its backward is the reduce-scatter (the sum over the group, this rank's
chunk), with no N.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import comm
from dsp_plugin import layout as carrier
from dsp_plugin.comm import chunk_sizes, dynamic_switch, gather, group_rank, group_size
from dsp_plugin.packing import offsets
from dsp_plugin.plan import recompute
from dsp_plugin.plan.spec import Layout

__all__ = ["infer_grid", "plan_gather", "plan_split", "plan_switch", "read_spec", "scale_grad", "spec_for"]


_SPECS: dict[tuple[Any, ...], carrier.ShardSpec] = {}  # tags are immutable: one object per placement


def spec_for(lay: Layout, grid: dict[str, int], shard: str) -> carrier.ShardSpec:
    """The carrier's tag of a tensor in ``lay`` sharded on axis ``shard``."""
    dim = lay.dim_of(shard)
    names = lay.dims[dim]
    lengths = tuple([grid[a] for a in names])
    key = (dim, lengths, names.index(shard))
    if torch.compiler.is_compiling():  # the lengths may be symbolic (dynamic=True): no cache
        return carrier.ShardSpec(dim, math.prod(lengths), lengths, key[2])
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        spec = _SPECS[key] = carrier.ShardSpec(dim, math.prod(lengths), lengths, key[2])
    return spec


def read_spec(x: torch.Tensor, lay: Layout) -> tuple[dict[str, int], str] | None:
    """(global grid, sharded axis) from ``x``'s tag read in ``lay``; None if untagged or another layout."""
    spec = carrier.shard_spec(x)
    if spec is None or spec.dim >= len(lay.dims) or len(spec.grid) != len(lay.dims[spec.dim]) \
            or x.dim() != len(lay.dims):
        return None
    grid = dict(zip(lay.dims[spec.dim], spec.grid))
    for d, names in enumerate(lay.dims):
        if d != spec.dim and len(names) == 1:
            grid[names[0]] = x.shape[d]
    return grid, lay.dims[spec.dim][spec.axis]


def infer_grid(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], *, shard: str | None = None,
               group: Any = None, members: tuple[int, int] | None = None) -> dict[str, int]:
    """``grid`` completed with the axes of ``x`` (at most one unknown axis per dim).

    ``x`` is the full tensor, or with ``shard`` this rank's shard of that axis (whose global length is in ``grid``);
    only then is ``group`` asked for this rank's place (a full tensor needs no group).
    """
    def length(a: str) -> int:
        if a != shard:
            return out[a]
        n, rank = _members(group, members)
        return chunk_sizes(out[a], n)[rank]

    if x.dim() != len(lay.dims):
        raise ValueError(f"{where}: expected a {len(lay.dims)}-dim tensor in layout '{lay}', got shape "
                         f"{tuple(x.shape)}")
    out = dict(grid)
    for d, names in enumerate(lay.dims):
        unknown = [a for a in names if a not in out]
        known = math.prod([length(a) for a in names if a in out])  # a list: dynamo traces no generator here
        if len(unknown) > 1:
            raise ValueError(f"{where}: dim {d} of layout '{lay}' folds {unknown}, whose lengths are unknown; "
                             f"give all but one in the plan's Grid")
        if unknown:
            if x.shape[d] % known:
                raise ValueError(f"{where}: dim {d} has {x.shape[d]} rows, not a multiple of "
                                 f"{dict((a, out[a]) for a in names if a in out)}")
            out[unknown[0]] = x.shape[d] // known
        elif x.shape[d] != known:
            raise ValueError(f"{where}: dim {d} of layout '{lay}' has length {x.shape[d]}, expected {known} "
                             f"({dict((a, out[a]) for a in names)})")
    return out


def _local_shape(lay: Layout, grid: dict[str, int], shard: str | None, n: int, rank: int,
                 x: torch.Tensor) -> list[int]:
    """Every axis of ``lay`` separate, with this rank's length of the sharded one."""
    shape: list[int] = []
    for d, names in enumerate(lay.dims):
        if len(names) == 1 and names[0] != shard:  # a whole dim that is not sharded: its full length
            shape.append(x.shape[d])
            continue
        for a in names:
            shape.append(chunk_sizes(grid[a], n)[rank] if a == shard else grid[a])
    return shape


def _members(group: Any, members: tuple[int, int] | None) -> tuple[int, int]:
    """The group's (size, this rank's place): ``members`` where the caller resolved them for its forward (the plan
    runtime, once per forward), else asked of the group."""
    return (group_size(group), group_rank(group)) if members is None else members


def _unfold(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str | None,
            group: Any, members: tuple[int, int] | None = None) -> torch.Tensor:
    n, rank = _members(group, members)
    shape = _local_shape(lay, grid, shard, n, rank, x)
    if math.prod(shape) != x.numel():
        raise ValueError(f"{where}: a tensor of shape {tuple(x.shape)} is not layout '{lay}' with global "
                         f"lengths {grid} sharded on {shard!r} over {n} ranks (rank {rank}); expected "
                         f"{shape} unfolded")
    return x.reshape(shape)


def _fold(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    shape, i = [], 0
    for names in lay.dims:
        shape.append(math.prod(x.shape[i:i + len(names)]))
        i += len(names)
    return x.reshape(shape)


def _tag(x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str) -> torch.Tensor:
    return carrier.attach_spec(x, spec_for(lay, grid, shard))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


def scale_grad(x: Any, factor: float) -> Any:
    """Identity forward; the gradient times ``factor`` (used on replicated outputs, 1/N)."""
    if isinstance(x, torch.Tensor) and factor != 1 and x.requires_grad:
        return _ScaleGrad.apply(x, factor)
    return x


def _chunk(where: str, length: int, n: int, rank: int) -> tuple[int, int]:
    """(first position, positions) of this rank's chunk of an axis of ``length``; an error below one per rank."""
    if length < n:
        raise ValueError(f"{where}: a sequence axis of length {length} cannot be split over {n} ranks; expected "
                         f"at least one element per rank (length >= {n})")
    sizes = chunk_sizes(length, n)
    return offsets(sizes)[rank], sizes[rank]


def _narrow(x: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
    comm.count_sharded_call()  # a shard is made: what the DeepSpeed guard checks a DSP model does
    # autograd's own narrow is the partial adjoint (the gradient in place, zeros elsewhere). Not an autograd
    # Function of ours: torch 2.11's dynamo drops the gradient of a Function applied in a forward pre-hook
    # (a follow argument's split: Latte's caption and timestep embeddings got none; fixed in 2.13)
    return x.narrow(dim, start, size).contiguous()


def partial_split(where: str, x: torch.Tensor, axis_index: int, group: Any, *, length: int | None = None,
                  inner: int = 1, members: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's chunk of dim ``axis_index`` (partial adjoint). ``length``/``inner``: the dim folds an axis of
    ``length`` positions outermost, each ``inner`` rows (``(F HW)`` split on F): chunks of that axis, whole rows.
    ``members``: the group's (size, rank), where the caller resolved them (here and in the functions below)."""
    n, rank = _members(group, members)
    start, size = _chunk(where, x.shape[axis_index] if length is None else length, n, rank)
    return _narrow(x, axis_index, start * inner, size * inner)


def row_split(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str,
              members: tuple[int, int]) -> tuple[int, int, int, carrier.ShardSpec] | None:
    """How ``plan_split`` cuts ``x`` where ``shard`` is the outermost axis of its dim (this rank's chunk is a block
    of rows): (dim, first row, rows, the shard's tag), for :func:`cut`; None where it unfolds the dim instead.
    A function of the shapes and lengths only: the plan runtime keeps it for the next forward's same split."""
    dim = lay.dim_of(shard)
    names = lay.dims[dim]
    if names[0] != shard or x.dim() != len(lay.dims):
        return None
    inner = math.prod([grid[a] for a in names[1:]])
    if x.shape[dim] != grid[shard] * inner:
        return None
    start, size = _chunk(where, grid[shard], *members)
    return dim, start * inner, size * inner, spec_for(lay, grid, shard)


def cut(x: torch.Tensor, rows: tuple[int, int, int, carrier.ShardSpec]) -> torch.Tensor:
    """``x``'s block of rows that :func:`row_split` found, tagged."""
    dim, start, size, tag = rows
    return carrier.attach_spec(_narrow(x, dim, start, size), tag)


def plan_split(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str,
               group: Any, *, members: tuple[int, int] | None = None) -> torch.Tensor:
    """Replicated ``x`` in ``lay`` -> this rank's chunk of axis ``shard``, tagged."""
    members = _members(group, members)
    if members[0] == 1:
        return x
    rows = row_split(where, x, lay, grid, shard, members)
    if rows is not None:
        return cut(x, rows)
    full = _unfold(where, x, lay, grid, None, group, members)
    local = partial_split(where, full, lay.axes.index(shard), group, members=members)
    return _tag(_fold(local, lay), lay, grid, shard)


def plan_switch(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], cur: str, tgt: str,
                group: Any, *, tail: bool = False, comm_dtype: object = None,
                members: tuple[int, int] | None = None) -> torch.Tensor:
    """S(cur) -> S(tgt) of ``x`` in ``lay``: one all-to-all, not re-issued under recompute; tagged.
    ``comm_dtype``: the payload's wire format (``dsp_plugin.comm.payload``)."""
    members = _members(group, members)
    if members[0] == 1:
        return x
    u = _unfold(where, x, lay, grid, cur, group, members)
    axes = lay.axes
    y = recompute.replay((where, "switch", cur, tgt), lambda u: dynamic_switch(
        u, axes.index(cur), axes.index(tgt), group=group, global_len=grid[cur], comm_dtype=comm_dtype), u,
        tail=tail)
    return _tag(_fold(y, lay), lay, grid, tgt)


def plan_gather(where: str, x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str,
                group: dist.ProcessGroup | None, *, members: tuple[int, int] | None = None,
                partial_grad: bool = False) -> torch.Tensor:
    """S(shard) -> R: one all_gather, not re-issued under recompute; backward N x its own chunk, or with
    ``partial_grad`` the reduce-scatter (module docstring)."""
    members = _members(group, members)
    n = members[0]
    if n == 1:
        return x
    u = _unfold(where, x, lay, grid, shard, group, members)
    y = recompute.replay((where, "gather"), lambda u: gather(
        u, lay.axes.index(shard), group=group, global_len=grid[shard], partial_grad=partial_grad), u)
    return _fold(y, lay) if partial_grad else scale_grad(_fold(y, lay), float(n))


def tag(x: torch.Tensor, lay: Layout, grid: dict[str, int], shard: str) -> torch.Tensor:
    return _tag(x, lay, grid, shard)
