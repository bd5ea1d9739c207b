"""A plan's module paths matched against a model, and a hooked module call's arguments by name."""

from __future__ import annotations

import inspect
import re
import weakref
from typing import Any

import torch
from torch import nn

from dsp_plugin.plan.frames import OnShard
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

__all__ = ["Args", "expand", "map_tensors", "tensors"]


def expand(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, nn.Module, list[Any]]]:
    """``[(path, module, specs)]`` in the model's module order; ``*`` matches any one path component."""
    names = dict(model.named_modules())
    found: dict[str, list[Any]] = {}
    for pattern, specs in plan.items():
        specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in names if regex.match(n)]
        if not hits:
            raise ValueError(f"plan: {pattern!r} matches no module of {type(model).__name__}")
        for spec in specs:
            if isinstance(spec, Grid) and pattern != "":
                raise ValueError(f"plan: Grid belongs to the model itself (path ''), not {pattern!r}")
            if not isinstance(spec, (Block, Gather, Grid, Heads, OnShard, Positions, Split)):
                raise TypeError(f"plan: {pattern!r} has {spec!r}; expected Split, Block, Heads, Gather or Grid "
                                f"(or Positions, OnShard)")
        for n in hits:
            found.setdefault(n, []).extend(specs)
    return [(n, names[n], found[n]) for n in names if n in found]


_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature] = weakref.WeakKeyDictionary()


def _signature(forward: Any) -> inspect.Signature:
    """``inspect.signature`` of a bound ``forward``, once per function (it costs ~50 us a call, on every hook)."""
    func = getattr(forward, "__func__", None)
    if func is None:  # not a plain method (a partial, a callable object): no cache
        return inspect.signature(forward)
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = _SIGNATURES[func] = inspect.signature(forward)
    return sig


class Args:
    """A module call's arguments by name (``inspect.signature`` of its forward).

    An argument is named by its name or position, or by a path into a nested
    tuple/list argument: ``("image_rotary_emb", 1)`` is element 1 of that argument.
    Bound on first use (a hook that reads no argument, a ``Heads``-only module's,
    binds nothing); ``changed`` says whether ``set`` ran (else the call's own
    arguments stand).
    """

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self._sig: inspect.Signature | None = None
        self._bound: inspect.BoundArguments | None = None
        self.changed = False

    @property
    def sig(self) -> inspect.Signature:
        if self._sig is None:
            self._sig = _signature(self.module.forward)
        return self._sig

    @property
    def bound(self) -> inspect.BoundArguments:
        if self._bound is None:
            self._bound = self.sig.bind_partial(*self.args, **self.kwargs)
        return self._bound

    def name(self, arg: str | int | tuple[Any, ...]) -> str:
        if isinstance(arg, tuple):
            return self.name(arg[0])
        return list(self.sig.parameters)[arg] if isinstance(arg, int) else arg

    def get(self, arg: str | int | tuple[Any, ...]) -> Any:
        value = self.bound.arguments.get(self.name(arg))
        for i, index in enumerate(arg[1:] if isinstance(arg, tuple) else ()):
            if value is None:  # an optional argument the caller left out stays out
                return None
            if not isinstance(value, (tuple, list)) or not -len(value) <= index < len(value):
                raise ValueError(f"argument path {arg!r}: {arg[:i + 1]!r} is {_describe(value)}; expected a "
                                 f"tuple or list with an element {index}")
            value = value[index]
        return value

    def set(self, arg: str | int | tuple[Any, ...], value: Any) -> None:
        if isinstance(arg, tuple) and len(arg) > 1:  # rebuild the nested tuples/lists around the new element
            parent = self.get(arg[:-1])
            items = list(parent)
            items[arg[-1]] = value
            value = type(parent)(items) if isinstance(parent, list) or type(parent) is tuple else type(parent)(*items)
            return self.set(arg[:-1], value)
        self.bound.arguments[self.name(arg)] = value
        self.changed = True

    def out(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._bound is None:
            return self.args, self.kwargs
        return tuple(self.bound.args), dict(self.bound.kwargs)


def _describe(value: Any) -> str:
    return f"a tuple of {len(value)}" if isinstance(value, (tuple, list)) else type(value).__name__


def map_tensors(out: Any, fn: Any) -> Any:
    """``out`` with ``fn`` applied to every tensor in it (nested tuples, lists, dicts); other values as they are."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(map_tensors(o, fn) for o in out)
    if isinstance(out, dict):  # diffusers' BaseOutput is an OrderedDict that mirrors attributes
        for k in list(out.keys()):
            out[k] = map_tensors(out[k], fn)
        return out
    return out


def tensors(out: Any) -> list[torch.Tensor]:
    """The tensors ``map_tensors`` visits, in its order (nothing is changed)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    return []
