"""The head switch at diffusers' attention dispatch: every registered backend wrapped, a no-op outside ``Heads``.

diffusers' attention processors call ``dispatch_attention_fn``, which looks the
backend function up in ``_AttentionBackendRegistry._backends`` at every call
(``model.set_attention_backend("flex")``, the ``attention_backend`` context, or
the environment's default). :func:`install` replaces each function there by a
wrapper, once (idempotent; run at ``parallelize`` and at every forward of a model with ``Heads``, so
a backend registered later is wrapped too). Outside a ``Heads`` module call the
wrapper calls the backend unchanged; inside one, q, k, v ``[B, L_local(+R), H,
Dh]`` go through ``HeadsCall.attend`` (``dsp_plugin.plan.attention``): the
ORIGINAL backend runs on ``[B, L(+R), H_local, Dh]`` with every other argument as
given, and the output switches back. Every diffusers backend takes and returns
that layout (the varlen ones pack the sequence inside, from the mask, after the
switch: the global mask gives the global packing), so every one can be wrapped.

Refused on every rank, naming the backend, before any collective of the call:

- ``_parallel_config`` set (diffusers' own context parallelism on the same
  attention: two sequence shardings at once); also at ``parallelize`` time
  (:func:`check_model`);
- ``return_lse=True`` (the log-sum-exp has its own layout; only diffusers' ring
  attention asks for it);
- a function without ``query``, ``key``, ``value`` arguments (not a diffusers
  backend's signature).

diffusers' optional constraint checks (``DIFFUSERS_ATTN_CHECKS=1``) run in
``dispatch_attention_fn`` before the backend, on the local q, k, v: inside a
``Heads`` call they would compare a global mask with the local key length, so the
wrapped constraints wait for the switch and run there, on what the kernel sees.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode as _top_function_mode
from torch.overrides import _pop_mode_temporarily

from dsp_plugin.plan.attention import current_call

__all__ = ["check_model", "install", "wrapped"]

_QKV = ("query", "key", "value")


_REGISTRY: list[Any] = []  # diffusers' registry class, once imported


def _registry() -> Any:
    if _REGISTRY:
        return _REGISTRY[0]
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:  # diffusers is optional: no dispatch to wrap
        return None  # not remembered: diffusers may be installed in this process later
    _REGISTRY.append(_AttentionBackendRegistry)
    return _AttentionBackendRegistry


def wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of this module's wrappers."""
    return getattr(fn, "_dsp_heads_original", None) is not None


def _refusal(name: str, kwargs: dict[str, Any], where: str) -> ValueError | None:
    if "query" not in kwargs or "key" not in kwargs or "value" not in kwargs:
        return ValueError(f"{where}: attention backend {name!r} takes {sorted(kwargs)}; the head switch wraps "
                          f"backends called with query, key, value [B, L, H, Dh] (diffusers' signature)")
    if kwargs.get("_parallel_config") is not None:
        return ValueError(f"{where}: attention backend {name!r} is called with diffusers' context parallelism "
                          f"(_parallel_config set); expected it off under dsp_plugin.parallelize (one sequence "
                          f"sharding: do not call enable_parallelism on this model)")
    if kwargs.get("return_lse"):
        return ValueError(f"{where}: attention backend {name!r} is asked for return_lse=True; the head switch "
                          f"returns the attention output only (expected return_lse=False)")
    return None


def _wrap_backend(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    label = getattr(name, "value", name)

    @functools.wraps(fn)
    def backend(*args: Any, **kwargs: Any) -> Any:
        call = current_call()
        if call is None or call.in_kernel:
            return fn(*args, **kwargs)
        if args:  # dispatch_attention_fn passes keywords only; a direct caller may not
            kwargs = dict(zip(inspect.signature(fn).parameters, args)) | kwargs
        error = _refusal(label, kwargs, call.where)
        q, k, v = kwargs.get("query"), kwargs.get("key"), kwargs.get("value")
        if error is not None and not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise error  # nothing to agree on: the same on every rank (the model's code, not its data)

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
            given = kwargs | {"query": q, "key": k, "value": v}
            if "attn_mask" in kwargs:
                given["attn_mask"] = mask
            if _REGISTRY and _REGISTRY[0]._checks_enabled:  # diffusers' DIFFUSERS_ATTN_CHECKS (off by default)
                _deferred_checks(name, given)
            return fn(**given)

        if call.mode_entered and _top_function_mode() is call.mode:
            # the SDPA level is not needed while this call attends (the kernel's own SDPA passes through it):
            # the head switch's copies and collectives run without a Python call per op (as under the SDPA
            # level, whose handler runs with its mode popped)
            with _pop_mode_temporarily():
                return call.attend(kernel, q, k, v, kwargs.get("attn_mask"), seq=1, head=2, error=error)
        return call.attend(kernel, q, k, v, kwargs.get("attn_mask"), seq=1, head=2, error=error)

    backend._dsp_heads_original = fn  # type: ignore[attr-defined]
    return backend


def _wrap_constraint(check: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(check)
    def constraint(*args: Any, **kwargs: Any) -> Any:
        call = current_call()
        if call is not None and not call.in_kernel:
            return None  # inside a Heads call: checked after the switch (_deferred_checks)
        return check(*args, **kwargs)

    constraint._dsp_heads_original = check  # type: ignore[attr-defined]
    return constraint


def _deferred_checks(name: Any, kwargs: dict[str, Any]) -> None:
    registry = _registry()
    if registry is None or not registry._checks_enabled:
        return
    for check in registry._constraints.get(name, []):
        getattr(check, "_dsp_heads_original", check)(**kwargs)


_installed: list[Any] = [None, None]  # what install() left in the registry: (backends, constraints) copies


def install() -> None:
    """Wrap every backend (and its constraint checks) registered in diffusers' dispatch; idempotent.

    Runs at every forward of a model with ``Heads``: when the registry holds what the last call left there
    (a dict comparison), nothing was registered or replaced since, and there is nothing to wrap."""
    registry = _registry()
    if registry is None:
        return
    if registry._backends == _installed[0] and registry._constraints == _installed[1]:
        return
    for name, fn in list(registry._backends.items()):
        if not wrapped(fn):
            registry._backends[name] = _wrap_backend(name, fn)
    for name, checks in list(registry._constraints.items()):
        if any(not wrapped(c) for c in checks):
            registry._constraints[name] = [c if wrapped(c) else _wrap_constraint(c) for c in checks]
    _installed[:] = [dict(registry._backends), {name: list(checks) for name, checks in registry._constraints.items()}]


def check_model(model: nn.Module, heads_paths: list[str]) -> None:
    """Refuse, at ``parallelize`` time, a ``Heads`` module whose attention diffusers already parallelizes,
    or whose backend cannot be wrapped (same on every rank: the model's configuration, not its data)."""
    registry = _registry()
    for path in heads_paths:
        for name, module in model.get_submodule(path).named_modules():
            processor = getattr(module, "processor", None)
            where = ".".join(p for p in (path, name) if p)
            if getattr(processor, "_parallel_config", None) is not None:
                raise ValueError(f"parallelize: {where} ({type(processor).__name__}) has diffusers' context "
                                 f"parallelism enabled (_parallel_config is set); expected it off: the plan's Heads "
                                 f"already shards this attention (one sequence sharding, not two)")
            backend = getattr(processor, "_attention_backend", None)
            if registry is None or backend is None:
                continue
            fn = registry._backends.get(backend)
            if fn is None:
                continue
            params = inspect.signature(getattr(fn, "_dsp_heads_original", fn)).parameters
            if any(arg not in params for arg in _QKV):
                raise ValueError(f"parallelize: {where} uses attention backend {getattr(backend, 'value', backend)!r}"
                                 f", whose function takes {list(params)}; the head switch wraps backends called "
                                 f"with query, key, value [B, L, H, Dh] (diffusers' signature)")
