"""What a forward of a parallelized model records while it runs: frames, ``sharded_io``, ``OnShard``.

A *frame* is this thread's record of one forward of one parallelized model,
opened by the model's own pre-hook and closed by its post-hook: the global grid
and the axis currently sharded. The hooks read it only where the model's own
inline reshapes between two blocks made a new, untagged tensor (Latte folds
``[B*T, S, D]`` into ``[B*S, T, D]`` with its own code): the local shape cannot
tell the global lengths, so the block reads them from the frame and tags its
input, where a recompute under activation checkpointing finds them again.

``sharded_io`` tells the frames opened inside it that the model is fed shards
and returns shards (sampling loops). ``OnShard`` is the plan's word for model
code that reads a *local* length when fed a shard and so computes something
else than on the full input (Latte adds its temporal positions only
``if num_frame > 1``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OnShard", "close_frame", "current_block", "current_frame", "frames", "open_frame", "sharded_io"]

_local = threading.local()
# the importing thread's, made now: a fresh model's first compiled call then reads what later calls read (made at
# its first read, dynamo guards on their absence, and the next call recompiles the whole forward)
_local.frames, _local.current = [], {}


def frames() -> list[Any]:
    """This thread's stack: ``sharded_io`` scopes, ``Frame`` records, and ``("block", spec, grid, shard, state)``
    (``state``: ``{"empty": this rank's shard is empty, "mode": the EmptyShardMode open for it}``)."""
    stack = getattr(_local, "frames", None)
    if stack is None:
        stack = _local.frames = []
    return stack


def open_frame(frame: Frame) -> None:
    """Push ``frame`` on this thread's stack; it is its owner's current one (:func:`current_frame`) until closed."""
    frames().append(frame)
    current = getattr(_local, "current", None)
    if current is None:
        current = _local.current = {}
    frame.outer = current.get(frame.owner)  # the owner's frame it is nested in (a model called inside itself)
    current[frame.owner] = frame


def close_frame(frame: Frame) -> None:
    """Take ``frame`` off this thread's stack; its owner's current frame is the one it was opened in again."""
    frames().remove(frame)
    current = getattr(_local, "current", None)
    if current is not None and current.get(frame.owner) is frame:
        if frame.outer is None:
            del current[frame.owner]
        else:
            current[frame.owner] = frame.outer


def current_frame(owner: Any) -> Frame | None:
    """The innermost open ``Frame`` of ``owner`` (a plan runtime) on this thread, or None: one lookup, not a walk
    of the stack (every hook asks)."""
    current = getattr(_local, "current", None)
    return None if current is None else current.get(owner)


@dataclass
class Frame:
    owner: Any  # the plan runtime whose forward this is (a dict key by identity: no ``id()``, an audited builtin)
    grid: dict[str, int] = field(default_factory=dict)
    shard: str | None = None
    sharded_io: bool = False
    io_shard: str | None = None  # under sharded_io: the axis the caller's shards are on (returned on it)
    handling: BaseException | None = None  # the exception being handled where the forward was called, if any
    masks: dict[int, Any] = field(default_factory=dict)  # under sharded_io: key-padding masks laid out (Heads)
    members: tuple[int, int] | None = None  # the plan's group: (size, this rank's place), resolved for this forward
    check_always: bool = False  # DSP_CHECK=1 (checks.check_mode), read once for this forward
    # (layout, tag) of the block whose output placement ``grid`` and ``shard`` are, and the tag it left on that
    # output (set by the post-hook of a block that switched nothing, on a non-empty shard; None once a split,
    # gather or switch moved them): a pass-through block of that layout whose input carries that tag or none runs
    # without its hooks in a forward without autograd (``_Runtime.bypass``)
    passing: Any = None
    outer: Frame | None = None  # open_frame: the owner's frame this one is nested in, current again when it closes


class sharded_io:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Feed the parallelized models called in this block (this thread) shards, and get shards back.

    ``with sharded_io(F=frames, HW=h * w): out = model(local_latents, ...)``: the
    keyword arguments are the global lengths of the sharded axis and of the axes
    folded with it (a full tensor, such as a positional table, is told from a
    shard by its length). A ``Split`` whose input is already this rank's shard
    only tags it, ``Gather`` returns the shard (on the axis the input was sharded
    on), ``Positions`` modules see the global shape, and ``OnShard`` corrections
    run. Per-row conditioning that the model repeats by its local length is
    recognised as local. For sampling loops that keep the latents sharded from
    the first step to the last.
    """

    def __init__(self, **axes: int) -> None:
        self.axes = {k: int(v) for k, v in axes.items()}

    def __enter__(self) -> sharded_io:
        frames().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        frames().remove(self)


def current_io() -> sharded_io | None:
    return next((f for f in reversed(frames()) if isinstance(f, sharded_io)), None)


def current_block() -> tuple[dict[str, int], str, Any] | None:
    """(grid, sharded axis, layout) of the innermost block running on this thread."""
    for f in reversed(frames()):
        if isinstance(f, tuple) and f[0] == "block":
            return f[2], f[3], f[1].layout
    return None


@dataclass(frozen=True)
class OnShard:
    """Under ``sharded_io``: correct argument ``arg`` of this module for model code that read a local length.

    ``fn(model, x, grid, local) -> x`` runs before the module, after its
    ``Block`` (so ``x`` has the placement the block runs on); ``grid`` holds the
    global lengths, ``local`` the lengths the model saw (the axis the caller's
    shards are on replaced by this rank's length). Latte's plan, for instance, adds the
    temporal positions a rank holding one frame of a longer video skipped. The
    correction is recorded on the module's input, so a recompute under
    activation checkpointing applies it again.
    """

    arg: str | int
    fn: Callable[[Any, Any, dict[str, int], dict[str, int]], Any]
