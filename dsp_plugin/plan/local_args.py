"""``Block(local=...)``: integer arguments the model computed from global lengths, given to a block as this rank's.

A model that passes a length to its blocks as a plain ``int`` (SanaVideo's ``frames``,
which its feed-forward unflattens its tokens into; Helios' ``original_context_length``,
the count of new tokens after its history) computes it from the whole sequence before
the tokens are split. On a shard the block needs this rank's count. The plan says
which arguments, and how (``Block.local``):

- an axis name, ``{"frames": "F"}``: the argument is that axis's global length; on a
  rank sharded on it, it becomes this rank's length (``tensor_split``'s chunk);
- a function ``fn(value, start, stop, total) -> int``: ``[start, stop)`` is this rank's
  range of the sharded axis (global length ``total``), for counts of a part of the
  sequence (Helios: the new tokens are the last ``value`` of ``total``, so this rank
  holds ``max(0, stop - max(start, total - value))`` of them).

The block's hooks apply it after placing the activation, in the forward and in a
recompute under activation checkpointing (the argument is the model's global value
again there). A value that is neither the global length nor this rank's is refused,
naming it.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.packing import chunk_sizes, offsets
from dsp_plugin.plan.spec import Block

__all__ = ["localize"]


def localize(path: str, a: Any, spec: Block, grid: dict[str, int], shard: str, members: tuple[int, int]) -> None:
    """Set ``spec.local``'s arguments of the call ``a`` (``plan.args.Args``) to this rank's values."""
    n, rank = members
    sizes = chunk_sizes(grid[shard], n)
    start = offsets(sizes)[rank]
    stop = start + sizes[rank]
    for name, rule in spec.local.items():
        value = a.get(name)
        if value is None:  # an optional argument the caller left out stays out
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: Block(local={{{name!r}: ...}}): the argument is {type(value).__name__} "
                             f"{value!r}; expected an int")
        if callable(rule):
            a.set(name, int(rule(value, start, stop, grid[shard])))
        elif rule == shard:
            if value == grid[rule]:
                a.set(name, sizes[rank])
            elif value != sizes[rank]:  # this rank's already (a model fed its shard)
                raise ValueError(f"{path}: Block(local={{{name!r}: {rule!r}}}): the argument is {value}; expected "
                                 f"the global length of {rule!r}, {grid[rule]}, or this rank's, {sizes[rank]}")
