"""No collective replayed when activation checkpointing recomputes a block.

diffusers checkpoints a block with ``torch.utils.checkpoint.checkpoint(block.__call__,
..., use_reentrant=False)``, so a plan's hooks run inside the checkpointed region and
backward's recompute would run the region's switches and head switches a second
time (Wan: 4 all-to-alls in backward become 8). :func:`replay` wraps each such
collective at its call site (``ops.plan_switch``, ``ops.plan_gather``, the head
switch in ``plan.attention``):

- forward, inside a region whose saved tensors are packed by hooks (a checkpoint):
  run the collective and keep its output (what torch's selective checkpointing,
  and torchtitan's policy for comm ops, saves);
- recompute (backward is running): hand the recompute the forward's output instead
  of issuing the collective again. The replayed output's backward is the original
  op's own backward (its autograd nodes, reached through gradient edges), for a
  checkpoint that differentiates its recompute (torch's non-reentrant one only
  takes the recomputed tensors, detached);
- no kept output (none was kept, or it cannot be told apart from another): run the
  collective, which is always correct.

Matching a recompute to its forward is exact: every top-level forward of a
parallelized model opens a *generation* (:func:`forward_starts`) at autograd's
current sequence number, and a recompute belongs to the generation of the autograd
node that triggered it (nodes are numbered in creation order, per thread: outputs
are kept only on the thread that opened the generation). Only the newest
generation is kept, so a recompute of an older forward (two forwards, then their
backwards) runs its collectives; a call site met twice in one generation (a module
called twice) keeps nothing. A head switch's key carries the index of the attention
call within its module's call (Mochi attends once per sample), which the recompute
of that module call meets again in the same order. Every decision follows the
program order, never the data, so all ranks skip the same collectives.

Memory: each kept output lives from its forward until its recompute takes it, or
until the end of the backward that reached it, or until the next forward starts;
nothing is kept when no saved-tensor hooks are active (no checkpointing) or grad is
off (inference). A switch after a block (``tail``) may end its checkpointed region,
and torch's checkpoint early stop (the default) ends a recompute at the region's last
saved tensor, before such a switch: so a tail's output is dropped at the next call
site if its region has ended by then (the saved-tensor hooks changed), and kept when
the region goes on (a checkpoint around several blocks) or early stop is off.

Not covered: reentrant checkpointing (``use_reentrant=True``, Megatron's and DeepSpeed's) runs its forward
without grad, where nothing is kept, so its recompute issues the collectives (exact,
as before). GQA head switches are replayed like the others, evenly split or not: a
rank whose query heads straddle K/V groups repeats its K/V heads with expanded views,
which save no tensor, so the checkpoint's recompute saves what its forward saved
(``tests/test_survivors_plan.py``; an ``index_select`` there broke that).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

__all__ = ["forward_starts", "idle", "kept", "replay"]

_lock = threading.Lock()


class _Generation:
    """The outputs kept by one top-level forward: ``{key: _Entry}`` (None: the key was met twice)."""

    def __init__(self, start: int, thread: int) -> None:
        self.start, self.thread = start, thread
        self.entries: dict[Any, _Entry | None] = {}
        self.cleanup_queued: set[int] = set()
        self.tails: list[tuple[Any, Any]] = []  # (key, its region's pack hook) until it ends


class _Entry:
    def __init__(self, values: list[torch.Tensor], single: bool, in_edges: list[Any], out_edges: list[Any]) -> None:
        self.values, self.single, self.in_edges, self.out_edges = values, single, in_edges, out_edges


_current: _Generation | None = None


def _backward_running() -> bool:
    return torch._C._current_graph_task_id() != -1


def forward_starts() -> None:
    """A top-level forward of a parallelized model starts: a new generation replaces the kept outputs."""
    global _current
    if torch.compiler.is_compiling() or _backward_running():  # compiled: nothing kept (``replay``); or the
        return                                                   # model itself is being recomputed
    with _lock:
        _current = _Generation(torch._C._autograd._get_sequence_nr(), threading.get_ident())


def kept() -> int:
    """How many collective outputs are kept now (0 after a step: nothing leaks)."""
    with _lock:
        return 0 if _current is None else sum(e is not None for e in _current.entries.values())


def _pack_hook() -> Any:
    """The innermost saved-tensor pack hook (a non-reentrant checkpoint region's), or None."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def _drop_ended_tails() -> None:
    """Tails whose region has ended will not be recomputed (early stop): drop them."""
    with _lock:
        gen = _current
        if gen is None or not gen.tails or _early_stop_off():
            return
        pack, left = _pack_hook(), []
        for key, region in gen.tails:
            if region is not pack:
                if isinstance(gen.entries.get(key), _Entry):
                    del gen.entries[key]
            else:
                left.append((key, region))
        gen.tails = left


def _early_stop_off() -> bool:
    return getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is False


def _edge(t: Any) -> Any:
    return get_gradient_edge(t) if isinstance(t, torch.Tensor) and t.requires_grad else None


def _clear_after_backward(generation: weakref.ref[_Generation]) -> Callable[[torch.Tensor], None]:
    """A gradient hook: at the end of the backward that reached a kept output, drop what is left."""
    def hook(_: torch.Tensor) -> None:
        gen, task = generation(), torch._C._current_graph_task_id()
        if gen is None or task in gen.cleanup_queued:
            return
        gen.cleanup_queued.add(task)

        def clear() -> None:
            with _lock:
                gen.entries.clear()

        torch.autograd.Variable._execution_engine.queue_callback(clear)

    return hook


def _keep(key: Any, inputs: tuple[Any, ...], out: Any, tail: bool) -> None:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    with _lock:
        gen = _current
        if gen is None or gen.thread != threading.get_ident():
            return
        if key in gen.entries:  # met twice in one forward: which recompute is which is not known
            gen.entries[key] = None
            return
        gen.entries[key] = _Entry([o.detach() for o in outs], isinstance(out, torch.Tensor),
                                  [_edge(t) for t in inputs], [_edge(o) for o in outs])
        if tail:
            gen.tails.append((key, _pack_hook()))
    ref = weakref.ref(gen)
    for o in outs:  # the hook holds the generation weakly: it never keeps an output alive
        if o.requires_grad:
            o.register_hook(_clear_after_backward(ref))


def _take(key: Any) -> _Entry | None:
    """The kept output of ``key`` for the forward whose recompute is running, removed; None if none."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    with _lock:
        gen = _current
        if gen is None or node._sequence_nr() < gen.start:  # an older forward's recompute
            return None
        return gen.entries.pop(key, None)


class _Replay(torch.autograd.Function):
    """Forward: the kept output (no collective). Backward: the original op's own backward, through its edges."""

    @staticmethod
    def forward(ctx: Any, entry: _Entry, *inputs: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.in_edges, ctx.out_edges, ctx.inputs = entry.in_edges, entry.out_edges, len(inputs)
        return tuple(v.view_as(v) for v in entry.values)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        outs = [(e, g) for e, g in zip(ctx.out_edges, grads) if e is not None and g is not None]
        ins = [i for i, e in enumerate(ctx.in_edges) if e is not None]
        result: list[Any] = [None] * ctx.inputs
        if outs and ins:
            got = torch.autograd.grad([e for e, _ in outs], [ctx.in_edges[i] for i in ins],
                                      grad_outputs=[g for _, g in outs], retain_graph=True,
                                      create_graph=torch.is_grad_enabled(), allow_unused=True)
            for i, g in zip(ins, got):
                result[i] = g
        return (None, *result)


def idle() -> bool:
    """Whether :func:`replay` would only call its function now (and so may be skipped for a direct call): not
    in a recompute, nothing to keep (grad off or no checkpoint region), no tail to drop. Asked once for the
    collectives of one attention call (their grad mode and checkpoint region are the same)."""
    if torch.compiler.is_compiling():
        return True
    if _backward_running():
        return False
    gen = _current
    if gen is not None and gen.tails:
        return False
    return not torch.is_grad_enabled() or _pack_hook() is None


def replay(key: Any, fn: Callable[..., Any], *inputs: Any, enabled: bool = True, tail: bool = False) -> Any:
    """``fn(*inputs)`` (a collective: a tensor or a tuple of tensors), not re-issued under recompute.

    ``key`` names the call site (the module path and which collective); ``enabled``
    must be the same on every rank; ``tail``: the call may be the last thing in its
    checkpointed region (a switch after a block).
    """
    if not enabled or torch.compiler.is_compiling():  # a compiled region's recompute is AOTAutograd's own
        return fn(*inputs)
    if _backward_running():
        entry = _take(key)
        if entry is None:
            return fn(*inputs)
        out = _Replay.apply(entry, *inputs)
        return out[0] if entry.single else out
    gen = _current
    if gen is not None and gen.tails:  # read without the lock: _drop_ended_tails takes it
        _drop_ended_tails()
    out = fn(*inputs)
    if torch.is_grad_enabled() and _pack_hook() is not None:
        _keep(key, inputs, out, tail)
    return out
