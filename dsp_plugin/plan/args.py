"""A plan's module paths matched against a model, and a hooked module call's arguments by name."""

from __future__ import annotations

import inspect
import re
import types
import weakref
from typing import Any

import torch
from torch import nn

from dsp_plugin.plan.frames import OnShard
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split
from dsp_plugin.plan.wrap import runs

__all__ = ["Args", "expand", "known_places", "map_tensors", "tensors"]


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


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_PLACES: weakref.WeakKeyDictionary[Any, dict[str, int | None]] = weakref.WeakKeyDictionary()
_NOT_PLAIN: dict[str, int | None] = {}  # _PLACES' entry for a forward with *args or positional-only parameters


def _places(forward: Any) -> dict[str, int | None] | None:
    """Where each parameter of ``forward`` is passed: its position (also passable by name), or None (by keyword
    only); None for a signature with ``*args`` or positional-only parameters (``Args`` binds those)."""
    func = getattr(forward, "__func__", None)
    places = _PLACES.get(func) if func is not None else None
    if places is None:
        sig = _signature(forward)
        kinds = [p.kind for p in sig.parameters.values()]
        plain = inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.POSITIONAL_ONLY not in kinds
        places = {name: (i if p.kind in _POSITIONAL else None) for i, (name, p) in enumerate(sig.parameters.items())
                  if p.kind != inspect.Parameter.VAR_KEYWORD} if plain else _NOT_PLAIN
        if func is not None:  # a signature that is not plain is remembered too (not looked at every call)
            _PLACES[func] = places
    return None if places is _NOT_PLAIN else places


def known_places(module: nn.Module) -> tuple[Any, dict[str, int | None] | None] | None:
    """(``module.forward``'s function, ``_places`` of it), found now, for :class:`Args` to take as it is while its
    forward stays that function (``parallelize`` finds them for every hooked module): under torch.compile the hooks
    are traced, and reading the cache above there traces ``inspect.signature`` (dynamo cannot read a
    ``WeakKeyDictionary``), which leaves ~170 guards on ``inspect`` to evaluate at every compiled call."""
    forward = runs(module)
    return (forward.__func__, _places(forward)) if isinstance(forward, types.MethodType) else None


class Args:
    """A module call's arguments by name (``inspect.signature`` of its forward).

    An argument is named by its name or position, or by a path into a nested
    tuple/list argument: ``("image_rotary_emb", 1)`` is element 1 of that argument.
    Read and replaced where the call passed it (by position or by keyword), as
    ``inspect.Signature.bind_partial`` would find it, without binding the whole
    call (the hooks run on every call of every planned module); a forward with
    ``*args`` or positional-only parameters is bound. ``changed`` says whether
    ``set`` ran (else the call's own arguments stand).
    """

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 known: tuple[Any, dict[str, int | None] | None] | None = None) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self._known = known  # known_places(module), found before the call (or None)
        self._sig: inspect.Signature | None = None
        self._bound: inspect.BoundArguments | None = None
        self._places: dict[str, int | None] | None | bool = False  # False: not looked up yet
        self.changed = False

    def _lookup(self) -> dict[str, int | None] | None:
        if self._places is False:
            forward, known = runs(self.module), self._known  # inside the plan's wrapper (plan/wrap.py)
            # not getattr(forward, "__func__", None): torch 2.13's dynamo answers another object than __func__
            if known is not None and isinstance(forward, types.MethodType) and forward.__func__ is known[0]:
                self._places = known[1]  # the same forward as when they were found
            else:
                self._places = _places(forward)
        return self._places  # type: ignore[return-value]

    def _where(self, name: str) -> tuple[str, Any] | None:
        """("args", index) or ("kwargs", name) where the call passed parameter ``name``; None where it did not
        pass it; bound (``self.bound``) when the signature is not a plain one."""
        places = self._lookup()
        if places is None or self._bound is not None or name not in places:  # not plain, or **kwargs' own name
            return ("bound", name)
        if name in self.kwargs:
            return ("kwargs", name)
        index = places[name]
        return ("args", index) if index is not None and index < len(self.args) else None

    def passed(self) -> dict[str, Any]:
        """The arguments the call passed, by name, in the signature's order (``bound.arguments``), found without
        binding where the places are known (traced under torch.compile: no ``inspect``); those a ``**kwargs``
        takes by their own names."""
        places = self._lookup()
        if places is None or self._bound is not None:
            return dict(self.bound.arguments)
        values = {}
        for name, index in places.items():
            if name in self.kwargs:
                values[name] = self.kwargs[name]
            elif index is not None and index < len(self.args):
                values[name] = self.args[index]
        values.update({k: v for k, v in self.kwargs.items() if k not in places})
        return values

    @property
    def sig(self) -> inspect.Signature:
        if self._sig is None:
            self._sig = _signature(runs(self.module))
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

    def _read(self, name: str) -> Any:
        where = self._where(name)
        if where is None:
            return None
        kind, key = where
        if kind == "bound":
            return self.bound.arguments.get(key)
        return self.kwargs[key] if kind == "kwargs" else self.args[key]

    def _write(self, name: str, value: Any) -> None:
        where = self._where(name)
        kind, key = where if where is not None else ("kwargs", name)
        if kind == "bound":
            self.bound.arguments[key] = value
        elif kind == "kwargs":
            self.kwargs = {**self.kwargs, key: value}
        else:
            self.args = (*self.args[:key], value, *self.args[key + 1:])
        self.changed = True

    def get(self, arg: str | int | tuple[Any, ...]) -> Any:
        if type(arg) is str:  # a parameter by name (most specs): nothing to resolve or walk
            return self._read(arg)
        value = self._read(self.name(arg))
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
        self._write(self.name(arg), value)

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
