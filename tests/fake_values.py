"""Fake CUDA tensors that still carry values: FakeTensorMode for devices, the CPU beside it for the values.

``FakeTensorMode`` gives every tensor a device and a shape but no data, and it
applies CUDA's device rules: a ``cuda:0`` tensor meeting a ``cuda:1`` one, or a
CPU tensor (other than a 0-dim scalar) meeting a CUDA one, raises
``FakeTensorDeviceMismatchError``. What it cannot do is answer a question about
values: ``.tolist()``, ``.item()``, ``bool(t)``, ``.numpy()``. Production code
asks such questions about a collective's result: DSP's cross-rank agreement and
the DeepSpeed first-forward guard read an all-gathered table on the host, and
DeepSpeed's ZeRO-3 compares module traces across ranks before each forward.

:class:`CpuValues`, a dispatch mode entered inside the fake mode, runs every op a
second time on CPU tensors (the *values*, kept on each fake tensor as
``_values``), with every ``cuda`` device argument turned into ``cpu``. Views of
values alias their base's values and in-place ops mutate them, as on a device.
Collectives on values go through the same process group: torch's ``fake``
backend, which hallucinates every peer holding what this rank holds (an
all-gather repeats this rank's input; a broadcast leaves a non-root tensor as it
was). A value question on a fake tensor is answered from its values; where the
fake kernel cannot know an output shape (``nonzero``) the values give it. An op
without values (a CUDA-only kernel, a tensor created before the mode) leaves its
outputs without values, and a value question about them raises as FakeTensorMode
does. This is torch's ``fake_tensor_propagate_real_tensors`` idea without the
export machinery (shape env, fake/real cross-checks), and with the real tensors
on the CPU.

Every collective is also checked against NCCL's rule: its tensors must be on the
device the rank's process group is bound to (``cuda:LOCAL_RANK``); NCCL refuses
anything else with "Attempt to perform collective on tensor not on device passed
to init_process_group" (or hangs when two ranks use one GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["CollectiveDeviceError", "CpuValues", "outside_modes", "values_of"]

_ATTR = "_values"
_NO_VALUES = object()
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_VALUE_QUESTIONS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                    torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)


class CollectiveDeviceError(RuntimeError):
    """A collective's tensor is not on the device this rank's NCCL process group is bound to."""


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run plain CPU torch code: no dispatch mode and no fake mode active."""
    with _disable_current_modes(), unset_fake_temporarily():
        yield


def values_of(t: torch.Tensor) -> torch.Tensor | None:
    """The CPU values of a fake tensor (None when unknown); a real tensor is its own values."""
    if isinstance(t, FakeTensor):
        values = getattr(t, _ATTR, None)
        if values is not None and (values.shape != t.shape or values.dtype != t.dtype):
            return None     # stale: the tensor's metadata changed behind the mode's back
        return values
    return t


def _set_values(t: object, values: object) -> None:
    if isinstance(t, FakeTensor):
        setattr(t, _ATTR, values if isinstance(values, torch.Tensor) else None)


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op writes to, by its schema."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(tree_flatten(value)[0])
    return out


def _to_cpu_argument(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type != "cpu":
        return torch.device("cpu")
    return a


class CpuValues(TorchDispatchMode):
    """Compute every fake op's values on the CPU; check every collective's device (see the module docstring).

    ``collective_device`` is the device NCCL is bound to on this rank. ``on_collective``,
    when given, is called with ``(op name, devices)`` for every collective.
    ``cuda_generator(device)``: the generator whose state stands for that GPU's; a random
    op on a CUDA tensor draws its values from it, not from the CPU's default generator
    (as on a device, where the CPU's RNG state does not move).
    """

    def __init__(self, collective_device: torch.device, *,
                 on_collective: Callable[[str, list[torch.device]], None] | None = None,
                 cuda_generator: Callable[[torch.device], torch.Generator] | None = None) -> None:
        super().__init__()
        self.collective_device = collective_device
        self.on_collective = on_collective
        self.cuda_generator = cuda_generator

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._pin_memory.default:   # a copy into page-locked host memory: a CPU copy here
            func, args, kwargs = torch.ops.aten.clone.default, args[:1], {}
        flat, _ = tree_flatten((args, kwargs))
        if func.namespace in _COLLECTIVE_NAMESPACES and "barrier" not in func.__name__:  # a barrier's tensor is
            self._check_collective(func, flat)                                             # torch's CPU placeholder
        fakes = [a for a in flat if isinstance(a, FakeTensor)]
        known = all(values_of(a) is not None for a in fakes)
        if func in _VALUE_QUESTIONS and known:
            return self._real(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not known:
                raise
            device = fakes[0].device if fakes else torch.device("cpu")
            return self._fake_from_values(self._real(func, args, kwargs), device)
        real = self._real(func, args, kwargs, missing_ok=True) if known else _NO_VALUES
        fake_leaves, _ = tree_flatten(out)
        real_leaves, _ = tree_flatten(real)
        if real is _NO_VALUES or len(fake_leaves) != len(real_leaves):
            for t in [*_mutated(func, args, kwargs), *fake_leaves]:   # their values would be stale
                _set_values(t, None)
        else:
            for fake, value in zip(fake_leaves, real_leaves):
                _set_values(fake, value)
        return out

    def _real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, missing_ok: bool = False) -> Any:
        def real(a: Any) -> Any:
            return values_of(a) if isinstance(a, torch.Tensor) else _to_cpu_argument(a)

        real_kwargs = tree_map(real, kwargs)
        if real_kwargs.get("pin_memory"):
            real_kwargs["pin_memory"] = False     # pinning needs a CUDA driver
        try:
            with outside_modes(), self._device_generator(func, args, kwargs):
                return func(*tree_map(real, args), **real_kwargs)
        except Exception:
            if missing_ok:      # a kernel the CPU lacks (flash attention ...): these outputs carry no values
                return _NO_VALUES
            raise

    @contextlib.contextmanager
    def _device_generator(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        """A random op on a CUDA tensor draws from that device's generator: lend its state to the CPU's."""
        device = next((a.device for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), kwargs.get("device"))
        if (self.cuda_generator is None or kwargs.get("generator") is not None
                or torch.Tag.nondeterministic_seeded not in func.tags
                or not (isinstance(device, torch.device) and device.type == "cuda")):
            yield
            return
        generator, cpu_state = self.cuda_generator(device), torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)

    def _fake_from_values(self, real: Any, device: torch.device) -> Any:
        def fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            _set_values(out, value)
            return out

        return tree_map(fake, real)

    def _check_collective(self, func: Any, flat: list[Any]) -> None:
        devices = [a.device for a in flat if isinstance(a, torch.Tensor)]
        if self.on_collective is not None:
            self.on_collective(str(func), devices)
        wrong = sorted({str(d) for d in devices if d != self.collective_device})
        if wrong:
            raise CollectiveDeviceError(
                f"{func}: a tensor on {', '.join(wrong)}, but this rank's NCCL process group is bound to "
                f"{self.collective_device} (LOCAL_RANK={self.collective_device.index}); NCCL refuses it "
                f"('Attempt to perform collective on tensor not on device passed to init_process_group')")
