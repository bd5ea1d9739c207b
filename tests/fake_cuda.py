"""A fake GPU node in one CPU process: production code runs as LOCAL_RANK 1 with CUDA tensors and no GPU.

``fake_cuda_node()`` makes this process local rank 1 of a node with 2 GPUs:

- **the device**: ``torch.cuda`` answers as a driver would, starting on device 0
  as a fresh CUDA process does (``tests/fake_cuda_shim.py``); DeepSpeed gets its
  real ``CUDA_Accelerator``. Only device queries are answered: nothing of
  DeepSpeed, Megatron or diffusers is replaced;
- **tensors**: ``FakeTensorMode`` (every tensor created inside is fake, on its
  device, never backed by memory; a ``cuda:0`` or CPU tensor meeting a ``cuda:1``
  one raises) with the values computed on the CPU beside it
  (``tests/fake_values.py``), so host reads of a collective's result work;
- **autograd off** (``torch.no_grad()``): recording autograd on a CUDA tensor
  asks the driver for the current stream, which aborts the process without a GPU
  (torch needs a primary context). The tier runs forward passes and placement;
- **the process group**: torch's ``fake`` backend (``FakeStore``), with NCCL's
  device rule checked on every collective (``cuda:LOCAL_RANK``);
- gaps of torch 2.13's fake tensors closed: ``Module.to`` swaps a fake parameter
  with ``torch.utils.swap_tensors``, which refuses a tensor that anything holds
  a weak reference to (FakeTensorMode's own memo, DeepSpeed's parameter-name
  map; pytorch#185595, #196558), so fake tensors are swapped without that check
  after the memo's references are dropped; ``param.data = x`` leaves a fake
  tensor's device behind (a Python attribute); ``tolist``/``numpy`` read no
  dispatched op; and FakeTensorMode would initialise CUDA when
  ``torch.cuda.is_available()`` answers True, so it is told not to.

Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import copyreg
import os
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tests.fake_cuda_shim import IndexedCuda, Patches, Stream, deepspeed_cuda_accelerator, shim_cuda
from tests.fake_values import CpuValues, outside_modes, values_of

__all__ = ["FakeNode", "fake_cuda_node"]

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


def _shim_tensor_methods(patches: Patches) -> None:
    """The value questions C++ answers without dispatching, and ``param.data = x`` on a fake tensor, which
    swaps the storage but would leave the device and values behind."""
    tolist, numpy, record_stream = torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.record_stream
    data = torch._C.TensorBase.data

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

    def record_stream_(self: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, Stream):
            record_stream(self, stream)

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

    for name, value in (("tolist", tolist_), ("numpy", numpy_), ("record_stream", record_stream_)):
        patches.set(torch.Tensor, name, value)
    patches.set(FakeTensor, "data", property(get_data, set_data))


def _shim_swap(patches: Patches, mode: FakeTensorMode) -> None:
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
def fake_cuda_node(*, local_rank: int = 1, rank: int | None = None, world_size: int = 2, devices: int = 2,
                   init_process_group: bool = True) -> Iterator[FakeNode]:
    """This process as ``LOCAL_RANK=local_rank`` (global ``rank``, default the same) of a fake node.

    The current device starts at 0, as in a fresh CUDA process: code that forgets
    to bind ``cuda:LOCAL_RANK`` computes on ``cuda:0`` and fails. Inside, every
    new tensor is fake and carries CPU values; autograd is off.
    ``init_process_group=False`` leaves the ``fake`` process group to the framework
    (megatron.training's ``--fake-process-group``); it is destroyed on exit either way.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = local_rank if rank is None else rank
    if dist.is_initialized():
        raise RuntimeError("fake_cuda_node: a process group is already initialised in this process")
    patches, current = Patches(), [0]
    mode = _FakeCudaTensorMode(allow_non_fake_inputs=True)  # real CPU tensors exist: RNG states, host data
    node = FakeNode(torch.device("cuda", local_rank), rank, world_size, mode)
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(devices), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29499",
           "DSP_BACKEND": "nccl"}   # dsp_plugin.backend: this node has GPUs (the suite's default is gloo)
    with contextlib.ExitStack() as stack:
        stack.callback(patches.undo)
        stack.enter_context(warnings.catch_warnings())
        # DeepSpeed's alignment asserts read data_ptr(); a fake tensor answers 0 and torch warns each time
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        shim_cuda(patches, devices, current)
        _shim_tensor_methods(patches)
        _shim_swap(patches, mode)
        stack.enter_context(_environment(env))
        stack.enter_context(deepspeed_cuda_accelerator())
        if init_process_group:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        stack.callback(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
        stack.enter_context(torch.no_grad())
        stack.enter_context(IndexedCuda())
        stack.enter_context(mode)
        stack.enter_context(CpuValues(node.device, on_collective=lambda op, d: node.collectives.append((op, d)),
                                      cuda_generator=lambda device: torch.cuda.default_generators[device.index]))
        yield node
