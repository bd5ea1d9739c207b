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

__all__ = ["Args", "expand", "map_tensors"]


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
    """A module call's arguments by name (``inspect.signature`` of its forward)."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.sig = _signature(module.forward)
        self.bound = self.sig.bind_partial(*args, **kwargs)

    def name(self, arg: str | int) -> str:
        return list(self.sig.parameters)[arg] if isinstance(arg, int) else arg

    def get(self, arg: str | int) -> Any:
        return self.bound.arguments.get(self.name(arg))

    def set(self, arg: str | int, value: Any) -> None:
        self.bound.arguments[self.name(arg)] = value

    def out(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(self.bound.args), dict(self.bound.kwargs)


def map_tensors(out: Any, fn: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(map_tensors(o, fn) for o in out)
    if isinstance(out, dict):  # diffusers' BaseOutput is an OrderedDict that mirrors attributes
        for k in list(out.keys()):
            out[k] = map_tensors(out[k], fn)
        return out
    return out
