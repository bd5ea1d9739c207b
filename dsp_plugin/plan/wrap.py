"""The plan's hooks around a module's own forward: a wrapper set as the module's ``forward``, not torch's hooks.

A module with a forward hook takes ``Module._call_impl``'s general path at every call (a closure, the
hook dicts, its always-call handler): measured cold, as in a forward after a kernel, a module with one
pre- and one post-hook costs ~9 us a call more than the same two hooks called from a wrapper, and a plan
hooks every block and attention module of a model (CHANGELOG.md, the runtime-cost rounds). So a planned
module's hooks run from :class:`Forward`, set as the instance's ``forward``; torch's own hooks, a
framework's included, still run around it, and torch's call path stays its fast one.

Torch's hooks survive a forward replaced on the instance; a wrapper does not. So the model's own pre-hook
(the one hook the plan keeps with torch) checks at every eager forward that each wrapper is still what its
module calls, by itself or inside what wraps it (``__wrapped__``, as ``functools.wraps``, diffusers' hooks
and accelerate's leave it), and wraps a replaced forward again (:func:`still_wrapped`): the plan keeps
applying to it, as a hook would.

A wrapper is what torch's ``always_call`` hooks were: its post-hook runs after the forward raised (with no
output; an error it raises then is a warning, the forward's error is the one raised), and after the
pre-hook raised.
"""

from __future__ import annotations

import inspect
import logging
import types
import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["Forward", "Handle", "not_a_tensor", "runs", "still_wrapped", "wrap", "wrappers"]

_log = logging.getLogger("dsp_plugin.plan")


class Forward:
    """``module``'s forward with the plan's ``pre`` and ``post`` around it (torch's hook signatures with keyword
    arguments: ``pre(module, args, kwargs) -> (args, kwargs) | None``, ``post(module, args, kwargs, output)
    -> output | None``; either may be None).

    ``inner``: the forward the instance had before (a framework's wrapper), or None: its class's. ``active``:
    False once the plan is removed while something else wraps this one (``unwrap``): a plain call then.
    ``bypass(module, args, kwargs)``, or None: asked first in an eager call; None: the hooks run; any other
    value: this call runs without them (their work is known to be done already, ``_Runtime.bypass``) and its
    output is ``bypass.finish(output, value)``.
    """

    def __init__(self, module: nn.Module, pre: Any, post: Any, bypass: Any = None) -> None:
        self.module, self.pre, self.post, self.active, self.bypass = module, pre, post, True, bypass
        self.replaced = False  # the module's forward was replaced after parallelize, and this wraps the new one
        self.finish = getattr(bypass, "finish", None)  # kept here: a bench may wrap ``bypass`` to time it
        self.inner: Any = module.__dict__.get("forward")
        self.call = self._call_target()

    def _call_target(self) -> Any:
        # the class's forward bound to the module: built here, never pickled (a bound method pickles as a lookup
        # of ``module.forward``, which finds this wrapper again)
        return self.inner if self.inner is not None else types.MethodType(type(self.module).forward, self.module)

    @property
    def __wrapped__(self) -> Any:
        """What this wrapper calls (``inspect.signature`` of the wrapper is that forward's)."""
        return self.call

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "call"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.call = self._call_target()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, pre, post = self.module, self.pre, self.post
        if not self.active:
            return self.call(*args, **kwargs)
        if torch.compiler.is_compiling():  # as torch's own call path: no handler traced around the call
            if pre is not None:
                changed = pre(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
            output = self.call(*args, **kwargs)
            if post is None:
                return output
            result = post(module, args, kwargs, output)
            return output if result is None else result
        if self.bypass is not None:
            token = self.bypass(module, args, kwargs)
            if token is not None:
                return self.finish(self.call(*args, **kwargs), token)
        posted = False
        try:
            if pre is not None:
                changed = pre(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
            output = self.call(*args, **kwargs)
            if post is None:
                return output
            posted = True
            result = post(module, args, kwargs, output)
            return output if result is None else result
        except Exception:
            if post is not None and not posted:  # what torch does for an always_call hook
                try:
                    post(module, args, kwargs, None)
                except Exception as exc:
                    warnings.warn(f"the plan's post-hook raised an exception that was silenced as another error was "
                                  f"raised in forward: {exc}", stacklevel=2)
            raise


def runs(module: nn.Module) -> Any:
    """The forward a call of ``module`` runs: ``module.forward``, or the one the plan's wrapper calls."""
    forward = module.forward
    return forward.call if type(forward) is Forward else forward


def wrappers(model: nn.Module) -> list[Forward]:
    """The plan's wrappers on ``model``'s modules (the benches time their ``pre`` and ``post``)."""
    return [f for m in model.modules() if type(f := m.__dict__.get("forward")) is Forward]


def still_wrapped(module: nn.Module, wrapper: Forward, path: str) -> None:
    """Wrap ``module``'s forward again if it was replaced since: ``wrapper`` is what the module calls, or inside
    what it calls (``__wrapped__`` links), else the replacement is wrapped (``wrapper.inner`` becomes it)."""
    forward = module.__dict__.get("forward")
    seen = 0
    while forward is not None and forward is not wrapper and seen < 16:
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
    if forward is wrapper:
        return
    wrapper.inner = module.__dict__.get("forward")
    wrapper.call = wrapper._call_target()
    wrapper.replaced = True
    module.forward = wrapper
    _log.info("parallelize: %s's forward was replaced after parallelize; the plan wraps the new one",
              path or type(module).__name__)


def not_a_tensor(path: str, module: nn.Module, name: str, value: Any) -> str:
    """The error for a block whose activation, argument ``name`` of the forward it runs, is ``value``, no tensor:
    where that forward replaced the module's after parallelize (``still_wrapped``), which one and what to do."""
    said = f"{path}: the block's activation {name!r} is {type(value).__name__}; expected a tensor"
    wrapper = module.__dict__.get("forward")
    if type(wrapper) is not Forward or not getattr(wrapper, "replaced", False):
        return f"{said} (set Block.arg to the argument of {path}'s forward that carries the block's activation)"
    forward = wrapper.call
    try:
        params: list[str] | None = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a callable without a signature
        params = None
    shown = getattr(forward, "__qualname__", type(forward).__name__) + (f"({', '.join(params)})" if params else "")
    lacks = ", which it does not have" if params is not None and name not in params else ""
    return (f"{said}. {path}'s forward was replaced after parallelize by {shown}; the plan wraps a replacement "
            f"again at the next eager call and reads the activation from its argument {name!r} (Block.arg){lacks}. "
            f"Keep the forward's parameter names in the replacement, set Block.arg to the replacement's activation "
            f"(Block(arg=...)), or replace the forward before parallelize (under torch.compile a forward replaced "
            f"after parallelize is not wrapped again: its module runs without the plan until an eager call)")


def wrap(module: nn.Module, pre: Any, post: Any, bypass: Any = None) -> Handle:
    """Set ``Forward(module, pre, post, bypass)`` as ``module``'s forward; the handle removes it."""
    wrapper = Forward(module, pre, post, bypass)
    module.forward = wrapper
    return Handle(module, wrapper)


class Handle:
    """``remove()`` undoes :func:`wrap`: the module's forward is what it was; if something else wraps the wrapper
    now, the wrapper stays inside that and passes calls through."""

    def __init__(self, module: nn.Module, wrapper: Forward) -> None:
        self.module, self.wrapper = module, wrapper

    def remove(self) -> None:
        module, wrapper = self.module, self.wrapper
        if module.__dict__.get("forward") is wrapper:
            if wrapper.inner is None:
                del module.__dict__["forward"]
            else:
                module.forward = wrapper.inner
        wrapper.active = False
