"""Every tensor of a module's output, named and placed, compared with the one-process run forward and backward.

A module's output is walked like ``args.map_tensors`` (tuples, lists, dicts,
diffusers' ``BaseOutput`` classes, which are dicts) and each tensor gets a name:
``output``, ``output[1]``, ``output.sample``, ``output['x'][0]``. Each is placed
against the reference's tensor of the same name: whole when replicated, else the
chunk its shard tag names (``layout.ShardSpec``); an untagged tensor takes the
tag of a tagged one beside it in the same output (a block returning a tuple tags
its first element: Wan VACE's control blocks return (hint, control stream), both
on the block's placement), else the enclosing block's placement, else, for a
module with a ``Block`` spec, the placement the forward holds after it.

Backward, each output tensor's gradient is compared the same way. The project's
convention (``plan.ops``): a sharded tensor's gradient is whole for its chunk on
its rank; a replicated one's is partial, summed over the group (one all_reduce
for all of them, outside the measured region). The model's own output is left
out: its gradient is the loss's weights on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsp_plugin import layout as carrier
from dsp_plugin.comm import chunk_sizes
from dsp_plugin.comm.collectives import all_reduce_sum
from dsp_plugin.packing import offsets
from dsp_plugin.plan import ops
from dsp_plugin.plan.frames import Frame, current_block, frames

__all__ = ["Element", "Placed", "named_tensors", "part_of", "place_output"]


@dataclass
class Element:
    """One tensor of a module's output, over the module's calls: the largest differences and reference values."""

    name: str
    out_diff: float | None = None   # max |this rank's tensor - the reference's part of it|
    out_scale: float = 0.0          # max |reference tensor|
    grad_diff: float | None = None  # the same for the tensor's gradient (backward)
    grad_scale: float = 0.0
    note: str = ""                  # why it was not compared (then the verdict is not OK)


def named_tensors(out: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in ``out`` (nested tuples, lists, dicts; a dict with attributes, as
    diffusers' output classes, by ``.key``), in ``args.map_tensors``' order."""
    if isinstance(out, torch.Tensor):
        return [(name, out)]
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return [nt for i, o in enumerate(out) for nt in named_tensors(o, f"{name}[{i}]")]
    if isinstance(out, dict):
        attrs = type(out) is not dict and all(isinstance(k, str) and k.isidentifier() for k in out)
        return [nt for k, o in out.items() for nt in named_tensors(o, f"{name}.{k}" if attrs else f"{name}[{k!r}]")]
    return []


@dataclass
class Placed:
    """A tensor of a planned module's output on this rank, with its placement and its gradient once backward ran."""

    name: str
    tensor: torch.Tensor
    spec: Any  # layout.ShardSpec, or None (replicated, or not placed)
    grad: torch.Tensor | None = None


def _frame_spec(t: torch.Tensor, block_layout: Any) -> Any:
    """The placement the innermost forward holds, in ``block_layout`` (a ``Block`` module's output, read after
    its post-hook), or None."""
    frame = next((f for f in reversed(frames()) if isinstance(f, Frame)), None)
    if block_layout is None or frame is None or frame.shard is None or t.dim() != len(block_layout.dims):
        return None
    try:
        return ops.spec_for(block_layout, frame.grid, frame.shard)
    except (KeyError, ValueError):
        return None


def place_output(output: Any, block_layout: Any = None) -> list[Placed]:
    """Every tensor of ``output`` with its placement (module docstring), read while the forward runs."""
    named = named_tensors(output)
    tags = [carrier.shard_spec(t) for _, t in named]
    tagged = [s for s in tags if s is not None]
    block = current_block()
    placed = []
    for (name, t), spec in zip(named, tags):
        if spec is None:
            sibling = next((s for s in tagged if s.dim < t.dim()), None)
            if sibling is not None:
                spec = sibling
            elif block is not None and t.dim() == len(block[2].dims):
                spec = ops.spec_for(block[2], block[0], block[1])
            else:
                spec = _frame_spec(t, block_layout)
        placed.append(Placed(name, t.detach(), spec))
    return placed


def part_of(ref: torch.Tensor, local: torch.Tensor, spec: Any, n: int, rank: int) -> torch.Tensor | None:
    """The part of the reference tensor ``ref`` that ``local`` (placed by ``spec``) holds on this rank; None if
    ``spec`` does not place it."""
    if local.shape == ref.shape:
        return ref
    if spec is None or spec.dim >= ref.dim() or ref.shape[spec.dim] != spec.global_len:
        return None
    sizes = chunk_sizes(spec.grid[spec.axis] if spec.grid else spec.global_len, n)
    grid = spec.grid or (spec.global_len,)
    part = ref.unflatten(spec.dim, grid).narrow(spec.dim + spec.axis, offsets(sizes)[rank], sizes[rank])
    part = part.flatten(spec.dim, spec.dim + len(grid) - 1)
    return part if part.shape == local.shape else None


def largest(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, in float64 (a difference in bf16 would round)."""
    return largest(a.double() - b.double())


def sum_replicated_grads(pairs: list[tuple[Placed, torch.Tensor]], n: int, group: Any) -> str:
    """Sum the gradients of the replicated tensors among ``pairs`` (``(placed, reference tensor)``: the same shape)
    over ``group`` in place (each rank's is its partial; none is zeros), in one all_reduce. Returns a note if the
    ranks disagree on what to sum (then nothing is summed)."""
    replicated = [p for p, r in pairs if p.tensor.shape == r.shape]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p.tensor) for p in replicated]
    flat = torch.cat([g.double().flatten() for g in grads]) if grads else torch.zeros(0, dtype=torch.float64)
    count = torch.tensor([float(flat.numel())], dtype=torch.float64)
    if n == 1:
        return ""
    all_reduce_sum(count, group=group)
    if count.item() != n * flat.numel():
        return "the ranks hold different replicated outputs: their gradients are not compared"
    if flat.numel():
        all_reduce_sum(flat, group=group)
    i = 0
    for p, g in zip(replicated, grads):
        p.grad = flat[i:i + g.numel()].view_as(g)
        i += g.numel()
    return ""
