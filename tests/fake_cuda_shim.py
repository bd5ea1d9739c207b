"""``torch.cuda`` without a driver: the device shim of the fake GPU node (``tests/fake_cuda.py``).

``shim_cuda(patches, devices, current)`` makes ``torch.cuda`` answer as a driver
would on a node with ``devices`` GPUs: available and initialised, a current
device that ``set_device`` moves (``current[0]``; 0 in a fresh process), H100
properties, streams and events that do nothing (every fake op is synchronous),
memory counters at 0, and one RNG state per device (CPU generators in
``torch.cuda.default_generators``, which Megatron's RNG tracker saves and sets).
``IndexedCuda``: an index-less ``cuda`` device in a torch call means the current
device, as in CUDA. DeepSpeed gets its real ``CUDA_Accelerator``, which calls the
shimmed ``torch.cuda``. Only device queries are answered; nothing of DeepSpeed,
Megatron or diffusers is replaced. ``Patches`` undoes every replacement.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["IndexedCuda", "Patches", "Stream", "deepspeed_cuda_accelerator", "shim_cuda"]

_H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3 (fake)", major=9, minor=0, total_memory=80 << 30,
                              multi_processor_count=132, gcnArchName="", L2_cache_size=50 << 20)


class Patches:
    """Attribute replacements, undone in reverse order (an inherited attribute is deleted again)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        own = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        self._undo.append((owner, name, vars(owner).get(name) if isinstance(owner, type) else
                           getattr(owner, name, None), own))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, old, own in reversed(self._undo):
            if own:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()


class Stream:
    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.priority = priority

    def wait_stream(self, other: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()


class _Event:
    def __init__(self, *_: Any, **__: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _device_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def shim_cuda(patches: Patches, devices: int, current: list[int]) -> None:
    cuda = torch.cuda

    def set_device(device: Any) -> None:
        index = _device_index(device)
        if not 0 <= index < devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (this fake node has {devices} GPUs)")
        current[0] = index

    @contextlib.contextmanager
    def device_context(device: Any) -> Iterator[None]:
        previous = current[0]
        if device is not None and _device_index(device) >= 0:
            set_device(device)
        try:
            yield
        finally:
            current[0] = previous

    answers: dict[str, Any] = {
        "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: devices,
        "current_device": lambda: current[0], "set_device": set_device, "device": device_context,
        "get_device_capability": lambda device=None: (_H100.major, _H100.minor),
        "get_device_properties": lambda device=None: _H100, "get_device_name": lambda device=None: _H100.name,
        "is_bf16_supported": lambda including_emulation=True: True,
        "mem_get_info": lambda device=None: (_H100.total_memory, _H100.total_memory),
        "Stream": Stream, "Event": _Event, "current_stream": lambda device=None: Stream(),
        "default_stream": lambda device=None: Stream(), "stream": lambda stream: contextlib.nullcontext(),
        "is_current_stream_capturing": lambda: False,
    }
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                 "reset_max_memory_cached", "reset_accumulated_memory_stats"):
        answers[name] = lambda *_, **__: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        answers[name] = lambda *_, **__: 0
    for name, value in answers.items():
        patches.set(cuda, name, value)
    _shim_cuda_rng(patches, devices, current)


def _shim_cuda_rng(patches: Patches, devices: int, current: list[int]) -> None:
    """One generator per device (CPU generators, holding the states Megatron's RNG tracker saves and sets)."""
    generators = tuple(torch.Generator() for _ in range(devices))

    def generator(device: Any = "cuda") -> torch.Generator:
        return generators[current[0] if device in (None, -1) else _device_index(device)]

    answers: dict[str, Any] = {
        "default_generators": generators,
        "get_rng_state": lambda device="cuda": generator(device).get_state(),
        "set_rng_state": lambda new_state, device="cuda": generator(device).set_state(new_state),
        "get_rng_state_all": lambda: [g.get_state() for g in generators],
        "set_rng_state_all": lambda states: [g.set_state(s) for g, s in zip(generators, states)],
        "manual_seed": lambda seed: generator().manual_seed(int(seed)),
        "manual_seed_all": lambda seed: [g.manual_seed(int(seed)) for g in generators],
        "seed": lambda: generator().seed(), "seed_all": lambda: [g.seed() for g in generators],
        "initial_seed": lambda: generator().initial_seed(),
    }
    for module in (torch.cuda, torch.cuda.random):
        for name, value in answers.items():
            if hasattr(module, name):
                patches.set(module, name, value)


class IndexedCuda(TorchFunctionMode):
    """An index-less ``cuda`` device in a torch call means the current device, as in CUDA.

    C++ resolves it with the real driver's current device (0 without one) in
    ``Tensor.to``/``.cuda()``/``torch.tensor(..., device="cuda")``; here the shim's.
    ``x.new_tensor(data)`` lands on the tensor's device (FakeTensorMode alone puts it on ``cuda:0``).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _indexed(args[1]), *args[2:])
        elif func is torch.Tensor.cuda and (len(args) < 2 or args[1] is None) and kwargs.get("device") is None:
            args, kwargs["device"] = args[:1], torch.cuda.current_device()
        elif func is torch.Tensor.new_tensor and kwargs.get("device") is None:
            kwargs["device"] = args[0].device   # FakeTensorMode puts it on cuda:0; CUDA on the tensor's device
        return func(*args, **kwargs)


def _indexed(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda" and device.index is None):
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def deepspeed_cuda_accelerator() -> Iterator[None]:
    try:
        from deepspeed.accelerator import real_accelerator
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    except ImportError:
        yield
        return
    previous = real_accelerator.ds_accelerator
    real_accelerator.set_accelerator(CUDA_Accelerator())
    try:
        yield
    finally:
        real_accelerator.ds_accelerator = previous
