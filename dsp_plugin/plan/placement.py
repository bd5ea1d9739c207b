"""Where a shard is: a tag's placement completed with the global lengths, full or shard, per-row conditioning.

The carrier's tag (``layout.ShardSpec``) holds the global lengths of the sharded
tensor dim's axes. A dim that folds other axes (``(B T)`` while the shard is on
S) takes theirs from the forward's frame, or, in a recompute under activation
checkpointing, from the input object itself (``GRID_ATTR``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsp_plugin import layout as carrier
from dsp_plugin.comm import chunk_sizes, group_rank, group_size
from dsp_plugin.plan import ops
from dsp_plugin.plan.frames import Frame
from dsp_plugin.plan.spec import Split

__all__ = ["GRID_ATTR", "complete", "holds_all", "is_full", "split_rows", "untagged"]

GRID_ATTR = "_dsp_plan_grid"


def complete(where: str, x: torch.Tensor, lay: Any, placed: tuple[dict[str, int], str],
              frame: Frame | None) -> tuple[dict[str, int], str]:
    """A tag's placement with the global lengths of every axis of ``lay``.

    The tag holds the sharded dim's axes only; a dim folding other axes (``(B T)`` while sharded on S)
    takes them from the forward's frame, or in a recompute from the input itself.
    """
    grid, shard = placed
    if holds_all(lay, grid, shard):
        return grid, shard
    needed = [ax for names in lay.dims if len(names) > 1 for ax in names] + [shard]  # a whole dim: its shape
    known = {**(frame.grid if frame is not None else {}), **carrier.noted(x, GRID_ATTR, {})}
    grid = {**{ax: known[ax] for ax in lay.axes if ax in known}, **grid}
    missing = [ax for ax in needed if ax not in grid]
    if missing:
        raise ValueError(f"{where}: the global lengths of {missing} (layout '{lay}') are not on the "
                         f"activation's tag and no forward of this model is in progress")
    carrier.note(x, GRID_ATTR, grid)  # a recompute (no frame) finds them on its input
    return grid, shard


def untagged(where: str, x: Any, frame: Frame | None) -> str:
    """What is wrong where a ``Gather`` meets an input without a shard tag and the forward holds no sharded axis
    to place it by: the input, and the placement the forward's frame holds (or that none is open)."""
    what = f"this tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else \
        f"this {type(x).__name__} (not a tensor)"
    if frame is None:
        held = "no forward of this model is in progress (a call outside its forward, or a recompute)"
    else:
        held = (f"the forward holds R (replicated: no Split has run before it, or a Gather ran already; global "
                f"lengths {frame.grid})")
    return (f"{where}: {what} has no shard tag, and {held}; expected a shard of the split activation (gather "
            f"only what a Split, Block or switch placed)")


def holds_all(lay: Any, grid: dict[str, int], shard: str) -> bool:
    """Whether ``grid`` has every global length ``complete`` needs: the sharded axis and every axis folded with
    others (a whole dim's length is its shape's)."""
    return shard in grid and all(ax in grid for names in lay.dims if len(names) > 1 for ax in names)


def is_full(x: torch.Tensor, spec: Split, grid: dict[str, int]) -> bool:
    """Under ``sharded_io``: is ``x`` the full tensor (a positional table built for the global grid)?"""
    dim = spec.layout.dim_of(spec.shard)
    names = spec.layout.dims[dim]
    if any(a not in grid for a in names):
        return False
    full = 1
    for a in names:
        full *= grid[a]
    return x.dim() > dim and x.shape[dim] == full


def split_rows(where: str, c: torch.Tensor, rows: Any, grid: dict[str, int], shard: str, group: Any) -> Any:
    """Conditioning that follows the activation -> this rank's part; the per-sample form and local rows are kept.

    ``rows`` lays out the leading dims of ``c``; the dim holding ``shard`` is split (``"(B T)"``: Latte's rows,
    ``"B J L K"``: SkyReels-V2's per-token modulation). ``c`` with fewer dims than ``rows``, or with length 1 on
    that dim, is the per-sample form the model broadcasts (SkyReels-V2's ``[B, 6, D]``, LTX-Video's ``[B, 1, 6D]``):
    left whole. A model fed shards (``sharded_io``) repeats its conditioning by its *local* length (Latte's
    ``timestep.repeat_interleave(num_frame)``): those rows are this rank's already.
    """
    d = rows.dim_of(shard)
    names = rows.dims[d]
    n, rank = group_size(group), group_rank(group)
    lengths = [grid[a] for a in names]
    local = [chunk_sizes(grid[a], n)[rank] if a == shard else grid[a] for a in names]
    if c.dim() < len(rows.dims) or (c.shape[d] == 1 and math.prod(lengths) > 1):
        return c
    if n > 1 and c.shape[d] == math.prod(local):
        return c
    if c.shape[d] != math.prod(lengths):
        raise ValueError(f"{where}: {c.shape[d]} rows on dim {d}, expected {' * '.join(names)} = {lengths} (the "
                         f"global rows), {local} (this rank's, sharded on {shard!r}) or 1 (one for every row)")
    u = c.unflatten(d, lengths)
    local_rows = ops.partial_split(where, u, d + names.index(shard), group)
    return local_rows.flatten(d, d + len(names) - 1)
