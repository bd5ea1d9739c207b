"""``plan.args.Args``: a hooked call's arguments read and replaced as ``inspect.Signature.bind_partial`` finds them.

The hooks read arguments where the call passed them (by position or keyword) without binding the whole call;
a forward with ``*args`` or positional-only parameters is bound. Oracle: ``bind_partial`` itself, and the
module called with what ``Args.out`` returns.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from dsp_plugin.plan.args import Args


class _Plain(nn.Module):
    def forward(self, x: Any, rope: Any = None, *, temb: Any = None, **extra: Any) -> tuple[Any, ...]:
        return x, rope, temb, extra


class _Star(nn.Module):
    def forward(self, x: Any, /, *rest: Any, temb: Any = None) -> tuple[Any, ...]:
        return x, rest, temb


CALLS = [((1,), {}), ((1, 2), {}), ((1,), {"rope": 2}), ((), {"x": 1, "temb": 3}), ((1, 2), {"temb": 3, "other": 4}),
         ((1,), {"other": 4})]


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_get_equals_bind_partial(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    module = _Plain()
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    a = Args(module, args, kwargs)
    for name in ("x", "rope", "temb", "other", "extra", 0, 1):
        key = list(inspect.signature(module.forward).parameters)[name] if isinstance(name, int) else name
        assert a.get(name) == bound.get(key), (name, a.get(name), bound.get(key))
    new_args, new_kwargs = a.out()
    assert not a.changed and module(*new_args, **new_kwargs) == module(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_set_calls_the_module_with_the_new_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    module = _Plain()
    for name, at in (("x", 0), ("rope", 1), ("temb", 2)):
        a = Args(module, args, dict(kwargs))
        a.set(name, "new")
        new_args, new_kwargs = a.out()
        assert a.changed and module(*new_args, **new_kwargs)[at] == "new", (name, new_args, new_kwargs)
        assert kwargs == dict(kwargs)  # the caller's dict is not changed in place


def test_nested_path_and_star_signature() -> None:
    module = _Plain()
    cos, sin = torch.zeros(2), torch.ones(2)
    a = Args(module, (1, (cos, sin)), {})
    assert a.get(("rope", 1)) is sin
    a.set(("rope", 1), "sin'")
    args, kwargs = a.out()
    assert module(*args, **kwargs)[1] == (cos, "sin'")
    star = _Star()  # *args and a positional-only parameter: bound
    a = Args(star, (1, 2, 3), {"temb": 4})
    assert (a.get("x"), a.get("rest"), a.get("temb")) == (1, (2, 3), 4)
    a.set("x", 9)
    args, kwargs = a.out()
    assert star(*args, **kwargs) == (9, (2, 3), 4)


def test_known_places_are_taken_while_the_forward_is_the_same() -> None:
    """``parallelize`` finds each hooked module's parameter places once (``known_places``: under torch.compile the
    hooks are traced, and finding them there traces ``inspect.signature``); a forward replaced on the instance
    afterwards is read by its own signature, not by the places found before."""
    from dsp_plugin.plan.args import known_places

    module = _Plain()
    known = known_places(module)
    assert known is not None and known[0] is _Plain.forward
    assert (Args(module, (1, 2), {"temb": 3}, known).get("rope"), Args(module, (1, 2), {}, known).get("x")) == (2, 1)

    def other(self: Any, rope: Any, x: Any = None) -> tuple[Any, ...]:  # the same names, other places
        return x, rope

    module.forward = other.__get__(module)
    a = Args(module, (1, 2), {}, known)
    assert (a.get("rope"), a.get("x")) == (1, 2)
    assert known_places(_Star()) is not None and known_places(nn.Linear(1, 1)) is not None
