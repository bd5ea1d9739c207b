"""The global length of a sharded dim, carried by the tensor that holds the shard.

A rank cannot see the full length of a dim it holds a ``tensor_split`` chunk of:
7 frames on 2 ranks and 8 frames on 2 ranks both leave rank 0 with 4. DSP needs
that length for every switch and gather (the all-to-all's split sizes), so the
primitives tag their outputs with a :class:`ShardSpec` — as DTensor carries its
global shape — and read it back from their inputs. Nothing lives in per-forward,
per-model or global state, so the primitives are re-entrant and thread-safe, and
two forwards of different lengths can be in flight at once.

A tag is a plain attribute of the tensor object. Two things drop attributes:

- ``detach()`` and other aliases make a new tensor object. Reentrant activation
  checkpointing (torch's and Megatron's) recomputes on detached inputs, so a
  tag is also found through a live *alias* of the same memory: a tagged tensor is
  remembered, weakly, by the address of its first element (``data_ptr``), shape,
  stride, dtype and device, and a tensor with exactly that view of the same memory
  is the same shard.
- Module code makes new tensors: a block's output is not its input. The DSP plan
  (``dsp_plugin.plan.runtime``) carries the tag from a block's input to its output
  with a forward hook (:func:`propagate`).

Where neither reaches (a tensor received over a pipeline P2P, a user's own
code), pass ``global_len=`` to the primitive, or let it ask the group (one small
all-gather and a host sync).

This is the project's ONE carrier of shard metadata: the primitives, the plan
runtime, the adapters and the Megatron layers read and write :class:`ShardSpec`
(as DTensor's ``DTensorSpec`` and PhysicsNeMo's ``ShardTensorSpec`` carry the
placement and global shape with the shard). A tensor dim may *fold* several
sequence axes row-major (Megatron's ``[T*S, B, D]``, Latte's ``[B*T, S, D]``):
``grid`` then holds the global length of each folded axis and ``axis`` the one
that is sharded, so a layer recovers every global length from the tag alone.
"""

from __future__ import annotations

import math
import weakref
from _weakref import _remove_dead_weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["ShardSpec", "attach", "attach_spec", "global_len_of", "propagate", "shard_spec"]

_ATTR = TAG_ATTR = "_dsp_shard_spec"  # the tag's attribute on a tensor (read directly by the plan's hot path)


@dataclass(frozen=True)
class ShardSpec:
    """``S(dim)`` with the full length ``global_len`` of that dim (``dim`` is non-negative).

    ``grid`` (optional): the global lengths of the sequence axes folded row-major
    into ``dim`` (their product is ``global_len``), and ``axis`` the index in
    ``grid`` of the axis that is sharded; the local length of ``dim`` is then the
    product of ``grid`` with ``grid[axis]`` replaced by this rank's chunk of it.
    Without a fold, ``grid == (global_len,)`` and ``axis == 0``.
    """

    dim: int
    global_len: int
    grid: tuple[int, ...] = ()
    axis: int = 0

    def __post_init__(self) -> None:
        if not self.grid:
            object.__setattr__(self, "grid", (self.global_len,))
        if not 0 <= self.axis < len(self.grid):
            raise ValueError(f"ShardSpec: axis={self.axis} is not an index of grid {self.grid}")
        if math.prod(self.grid) != self.global_len:
            raise ValueError(f"ShardSpec: grid {self.grid} folds {math.prod(self.grid)} elements into dim "
                             f"{self.dim}, but global_len={self.global_len}; expected their product")

    @property
    def sharded_len(self) -> int:
        """Global length of the sharded axis (``global_len`` without a fold)."""
        return self.grid[self.axis]

    def __str__(self) -> str:
        if len(self.grid) == 1:
            return f"S({self.dim}) of {self.global_len}"
        return f"S({self.dim}) folding {self.grid}, sharded on axis {self.axis}"


class _Alias(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a noted tensor that knows its key in ``_aliases``, where it is removed when the tensor
    dies. A plain dict of these, not a ``WeakValueDictionary``: every tag is one such entry (several a layer),
    and the dictionary's Python-level reference class and removal cost several calls each."""

    __slots__ = ("key",)


def _forget(ref: _Alias) -> None:
    """The tensor of ``ref`` died: its entry goes (unless a live tensor took the key since: kept)."""
    _remove_dead_weakref(_aliases, ref.key)


# (data_ptr, shape, stride, dtype, device) -> the noted tensor, weakly (``_alias_key``). A dict's single get, set and
# conditional removal are atomic: no lock.
_aliases: dict[tuple[object, ...], _Alias] = {}

# noted tensors not keyed in ``_aliases`` yet, weakly, in the order they were noted: keyed at the next lookup by
# alias (``noted`` on a tensor without the note), so most (activations freed before any such lookup) never are.
# A lookup finds what it would have found had every note been keyed at once: a dead tensor is skipped, a later note
# of the same key wins, and the key is the tensor's view as it is at the lookup (as a detach then would copy it).
_pending: list[weakref.ref[torch.Tensor]] = []
_PENDING_LIMIT = 1024  # keyed then anyway (dead ones dropped), so the list stays short in a loop that never looks up


def _key_pending() -> None:
    """Key every pending noted tensor that is alive (see ``_pending``)."""
    count = len(_pending)
    batch = _pending[:count]
    del _pending[:count]  # what other threads appended since stays (list slicing and deletion are atomic)
    for weak in batch:
        x = weak()
        key = None if x is None else _alias_key(x)
        if key is not None:
            ref = _Alias(x, _forget)
            ref.key = key
            _aliases[key] = ref


def storage_address(x: torch.Tensor) -> int:
    """Where ``x``'s storage lives: its data pointer, or for a fake tensor (``FakeTensorMode``, whose
    storages all have data pointer 0) the address of the storage object aliases share.

    The one identity of a tensor's memory used by the tag's aliases, ``accounting``'s saved bytes and
    Megatron's switch replay, so the same code runs on real and on fake tensors (``dsp_plugin.dryrun``).
    """
    plain = type(x) is torch.Tensor and not torch._is_functional_tensor(x)  # never fake: asked cheaply first
    if not plain and is_fake(x):  # FakeTensorMode (the dry run, torch.compile's tracing, the fake-device tests)
        return x.untyped_storage()._cdata
    return x.untyped_storage().data_ptr()


def _alias_key(x: torch.Tensor) -> tuple[object, ...] | None:
    """The same view of the same memory, as a key: the first element's address (a real tensor's ``data_ptr``; a
    fake one's storage object and offset, ``storage_address``), shape, strides, dtype and device. None for an empty
    or meta tensor (data pointer 0: no identity to key on)."""
    if not torch._is_functional_tensor(x) and (type(x) is torch.Tensor or not is_fake(x)):  # fake: asked last
        address = x.data_ptr()  # one call for the storage's address and offset (what storage_address costs twice)
        return None if address == 0 else (address, x.shape, x.stride(), x.dtype, x.device)
    if x.is_meta or x.numel() == 0:
        return None
    return (storage_address(x), x.storage_offset(), x.shape, x.stride(), x.dtype, x.device)


def attach(x: torch.Tensor, dim: int, global_len: int, *, grid: tuple[int, ...] = (),
           axis: int = 0) -> torch.Tensor:
    """Tag ``x`` as holding a chunk of dim ``dim`` whose full length is ``global_len``; returns ``x``.

    ``grid``/``axis`` describe a dim that folds several sequence axes (see :class:`ShardSpec`).
    """
    spec = ShardSpec(dim % x.dim(), int(global_len), tuple(int(g) for g in grid), int(axis))
    return note(x, _ATTR, spec)


def attach_spec(x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``attach`` with a tag already made (its dim counted from the front); returns ``x``."""
    return note(x, _ATTR, spec)


def shard_spec(x: torch.Tensor) -> ShardSpec | None:
    """The tag of ``x``, or of a live tensor that is exactly the same view of the same memory."""
    return noted(x, _ATTR)


def note(x: torch.Tensor, name: str, value: Any) -> torch.Tensor:
    """Attach ``value`` to ``x`` as attribute ``name``, found again on detached aliases of ``x``; returns ``x``.

    The tag above is one such note; the plan runtime keeps the global lengths of a replicated input's
    folded axes the same way, for a recompute that runs on a detached copy (reentrant checkpointing).
    """
    setattr(x, name, value)
    if torch.compiler.is_compiling():  # no aliases while tracing: reentrant recompute does not run compiled
        return x
    _pending.append(weakref.ref(x))  # keyed when a lookup by alias needs it (``_pending``)
    base = x._base
    if base is not None and _same_view(x, base):
        # an identity view made by a framework's hook (FSDP2's pre-forward hands a module such views of its inputs
        # that require grad): noted on the tensor it views too, which outlives it (a checkpoint holds that one),
        # so a recompute's new view of the same tensor finds the note
        setattr(base, name, value)
        _pending.append(weakref.ref(base))
    if len(_pending) > _PENDING_LIMIT:
        _key_pending()
    return x


def _same_view(x: torch.Tensor, base: torch.Tensor) -> bool:
    return (x.shape == base.shape and x.stride() == base.stride() and x.storage_offset() == base.storage_offset()
            and x.dtype == base.dtype)


def noted(x: torch.Tensor, name: str, default: Any = None) -> Any:
    """The note ``name`` of ``x``, or of a live tensor that is exactly the same view of the same memory."""
    value = getattr(x, name, None)
    if value is not None or torch.compiler.is_compiling():
        return default if value is None else value
    key = _alias_key(x)
    if key is None:
        return default
    if _pending:
        _key_pending()
    ref = _aliases.get(key)
    original = None if ref is None else ref()
    value = None if original is None else getattr(original, name, None)
    return default if value is None else value


def global_len_of(x: torch.Tensor, dim: int) -> int | None:
    """Full length of dim ``dim`` if ``x`` is tagged as a chunk of that dim, else None."""
    spec = shard_spec(x)
    return spec.global_len if spec is not None and spec.dim == dim % x.dim() else None


def propagate(source: torch.Tensor, target: object) -> None:
    """Tag ``target`` like ``source`` when it is plainly the same sharding (same rank, same local length).

    For module outputs: a block maps ``[B, T_local, S, D]`` to a tensor of the
    same shape, so the shard of its input is the shard of its output.
    """
    spec = shard_spec(source)
    if (spec is None or not isinstance(target, torch.Tensor) or target.dim() != source.dim()
            or target.shape[spec.dim] != source.shape[spec.dim]):
        return
    attach(target, spec.dim, spec.global_len, grid=spec.grid, axis=spec.axis)
