"""A fake 2-GPU node in one CPU process: production code runs as LOCAL_RANK 1 with CUDA tensors and no GPU.

``fake_cuda_node()`` makes this process local rank 1 of a node with 2 GPUs:

- a **device shim**: ``torch.cuda`` answers as a driver would (available, 2
  devices, ``set_device``/``current_device``, H100 properties, streams and
  events that do nothing, memory counters at 0). ``tensor.to("cuda")`` and
  ``.cuda()`` resolve the index in C++ with the real driver's current device
  (0 without one), so the shim resolves it in Python from its own current
  device, as CUDA does. DeepSpeed gets its real ``CUDA_Accelerator``, which
  calls the shimmed ``torch.cuda``. Nothing of DeepSpeed, Megatron or diffusers
  is replaced;
- **tensors**: ``FakeTensorMode`` (every tensor created inside is fake, on its
  real device: ``cuda:1`` for the model, never backed by memory) with the
  values computed on the CPU beside it (``tests.fake_values.CpuValues``), and
  ``torch.no_grad()``: recording autograd on a CUDA tensor asks the driver for
  the current stream, which aborts the process without a GPU (torch needs a
  primary context), so the tier runs forward passes and placement only;
- **the process group**: torch's ``fake`` backend (``FakeStore``), rank 1 of 2,
  with NCCL's device rule checked on every collective (``cuda:LOCAL_RANK``);
- two torch 2.13 gaps closed: ``Module.to`` swaps a fake parameter with
  ``torch.utils.swap_tensors``, which refuses any tensor that something holds a
  weak reference to (FakeTensorMode's own memo, DeepSpeed's parameter-name map),
  so the shim swaps fake tensors after dropping the memo's references (the fix
  of pytorch#196558 / #185595); and ``FakeTensorMode`` would initialise CUDA
  when ``torch.cuda.is_available()`` says True, so it is told not to.

Everything is restored on exit. Import cost: DeepSpeed only when installed.
"""

from __future__ import annotations

import contextlib
import copyreg
import os
import types
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tests.fake_values import CpuValues, outside_modes, values_of

__all__ = ["FakeNode", "fake_cuda_node"]

_H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3 (fake)", major=9, minor=0, total_memory=80 << 30,
                              multi_processor_count=132, gcnArchName="", L2_cache_size=50 << 20)


@dataclass
class FakeNode:
    """What a test sees of the fake node: this rank's device and every collective it issued."""

    device: torch.device
    rank: int
    world_size: int
    mode: FakeTensorMode
    collectives: list[tuple[str, list[torch.device]]] = field(default_factory=list)


class _FakeCudaTensorMode(FakeTensorMode):
    # FakeTensorMode creates a real CUDA tensor and constant-folds on the device when CUDA looks available.
    avoid_device_init = property(lambda self: True)  # type: ignore[assignment]


class _Patches:
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


class _Stream:
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


def _shim_cuda(patches: _Patches, devices: int, current: list[int]) -> None:
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
        "Stream": _Stream, "Event": _Event, "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(), "stream": lambda stream: contextlib.nullcontext(),
        "is_current_stream_capturing": lambda: False,
    }
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                 "reset_max_memory_cached", "reset_accumulated_memory_stats"):
        answers[name] = lambda *_, **__: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        answers[name] = lambda *_, **__: 0
    for name, value in answers.items():
        patches.set(cuda, name, value)


def _shim_tensor_methods(patches: _Patches) -> None:
    """Index-less ``cuda`` in ``.to``/``.cuda``; the value questions C++ answers without dispatching; and
    ``param.data = x`` on a fake tensor, which swaps the storage but would leave the device and values behind."""
    to, cuda, tolist, numpy = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.tolist, torch.Tensor.numpy
    record_stream = torch.Tensor.record_stream
    data = torch._C.TensorBase.data

    def indexed(device: Any) -> Any:
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda" \
                and torch.device(device).index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def to_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = indexed(kwargs["device"])
        return to(self, *(indexed(a) for a in args), **kwargs)

    def cuda_(self: torch.Tensor, device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        return cuda(self, torch.cuda.current_device() if device is None else device, *args, **kwargs)

    def tolist_(self: torch.Tensor) -> Any:
        values = values_of(self)
        if isinstance(self, FakeTensor) and values is not None:
            with outside_modes():
                return values.tolist()
        return tolist(self)

    def numpy_(self: torch.Tensor, *, force: bool = False) -> Any:
        if isinstance(self, FakeTensor):
            if self.device.type != "cpu" and not force:
                raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                                f"copy the tensor to host memory first.")
            values = values_of(self)
            if values is not None:
                with outside_modes():
                    return values.numpy(force=force)
        return numpy(self, force=force)

    def get_data(self: torch.Tensor) -> torch.Tensor:
        out = data.__get__(self)
        values = values_of(self)
        if isinstance(out, FakeTensor) and values is not None:
            with outside_modes():
                out._values = values.data
        return out

    def set_data(self: torch.Tensor, new: torch.Tensor) -> None:
        data.__set__(self, new)
        if isinstance(self, FakeTensor):   # a fake tensor's device is a Python attribute: it must follow too
            self.fake_device = new.device
            self._values = values_of(new)

    def record_stream_(self: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, _Stream):
            record_stream(self, stream)

    for name, value in (("to", to_), ("cuda", cuda_), ("tolist", tolist_), ("numpy", numpy_),
                        ("record_stream", record_stream_)):
        patches.set(torch.Tensor, name, value)
    patches.set(FakeTensor, "data", property(get_data, set_data))


def _shim_swap(patches: _Patches, mode: FakeTensorMode) -> None:
    swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) or isinstance(t2, FakeTensor)):
            return swap(t1, t2)
        memo = mode.fake_tensor_converter.meta_converter.tensor_memo
        for key, value in list(memo.items()):
            if value is t1 or value is t2:
                del memo[key]
        for t in (t1, t2):   # a structural weak reference (a weak container's key) would be corrupted: refuse
            if any(type(r) is not weakref.ReferenceType for r in weakref.getweakrefs(t)):
                raise RuntimeError("swap_tensors: a fake tensor is a key of a weak container")

        def swap_attr(name: str) -> None:
            tmp = getattr(t1, name)
            setattr(t1, name, getattr(t2, name))
            setattr(t2, name, tmp)

        swap_attr("__class__")
        swap_attr("__dict__")
        for slot in set(copyreg._slotnames(t1.__class__)):  # type: ignore[attr-defined]
            if hasattr(t1, slot) and hasattr(t2, slot):
                swap_attr(slot)
        torch._C._swap_tensor_impl(t1, t2)

    patches.set(torch.utils, "swap_tensors", swap_tensors)


@contextlib.contextmanager
def _deepspeed_cuda_accelerator() -> Iterator[None]:
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


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def fake_cuda_node(*, local_rank: int = 1, rank: int | None = None, world_size: int = 2,
                   devices: int = 2) -> Iterator[FakeNode]:
    """This process as ``LOCAL_RANK=local_rank`` (global ``rank``, default the same) of a fake node.

    The current device starts at 0, as in a fresh CUDA process: code that forgets
    to bind ``cuda:LOCAL_RANK`` computes on ``cuda:0`` and fails. Inside, every
    new tensor is fake and carries CPU values; autograd is off.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = local_rank if rank is None else rank
    if dist.is_initialized():
        raise RuntimeError("fake_cuda_node: a process group is already initialised in this process")
    patches, current = _Patches(), [0]
    mode = _FakeCudaTensorMode(allow_non_fake_inputs=False)
    node = FakeNode(torch.device("cuda", local_rank), rank, world_size, mode)
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(devices), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29499"}
    with contextlib.ExitStack() as stack:
        stack.callback(patches.undo)
        stack.enter_context(warnings.catch_warnings())
        # DeepSpeed's alignment asserts read data_ptr(); a fake tensor answers 0 and torch warns each time
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        _shim_cuda(patches, devices, current)
        _shim_tensor_methods(patches)
        _shim_swap(patches, mode)
        stack.enter_context(_environment(env))
        stack.enter_context(_deepspeed_cuda_accelerator())
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        stack.callback(dist.destroy_process_group)
        stack.enter_context(torch.no_grad())
        stack.enter_context(mode)
        stack.enter_context(CpuValues(node.device, on_collective=lambda op, d: node.collectives.append((op, d))))
        yield node
