"""Running megatron.training on CPU (gloo): one restorable CUDA shim, and the tests' train step.

megatron-core and ``megatron.training`` assume CUDA in device queries even where
the tensors could live anywhere. ``cuda_shim()`` answers exactly those, whether or
not the machine has CUDA: it *pins* the CPU path. The launch installs it only when
CUDA is absent (``cuda_is_real()``); the tests always do, so that ``make test`` runs
the same CPU path on a GPU machine. The base set serves megatron-core (layers, DDP,
schedules, argument validation):

============================================  =============================================
replaced (CPU only)                           Megatron call site that needs it
============================================  =============================================
``torch.cuda.current_device() -> cpu``        DDP grad buffers (``param_and_grad_buffer``),
                                              pipeline p2p receive buffers, timers
``torch.cuda.current_stream()`` no-op stream  ``start_grad_sync`` waits on CUDA-graph events
``torch.cuda.get_device_properties`` sm_90    ``validate_args`` (``get_device_arch_version``)
``torch.cuda.synchronize()`` no-op             p2p ``_communicate_shapes``, timers
``torch.cuda.Stream()``, ``stream()`` no-ops    ``get_model`` wraps DDP on a side stream
``torch.cuda.get/set_rng_state`` (empty),     rerun state machine saves the CUDA RNG per step;
also ``torch.cuda.random.*``                  activation recompute (``CheckpointFunction``)
``device="cuda"`` in factory calls -> cpu     schedules (``total_num_tokens``), p2p shapes,
(a ``TorchFunctionMode``), ``Tensor.cuda()``  ``pretrain``'s start-time all-reduces, loss dicts;
and ``Tensor.pin_memory()`` no-ops            the data loader pins batches for CUDA copies
============================================  =============================================

``cuda_shim(training=True)`` adds what ``megatron.training``'s own ``pretrain()``
and ``train()`` query, so that they run unchanged on gloo:

============================================  =============================================
``is_available() -> True``                    ``initialize_megatron`` asserts CUDA
``device_count() -> 1``, ``set_device`` no-op  ``_initialize_distributed`` builds the model-
                                              parallel groups (DSP in the CP slot) and
                                              ``_set_random_seed`` the RNG tracker only
                                              when it counts devices
``empty_cache``, ``reset_peak_memory_stats``  ``train()``, ``save_checkpoint_and_time``,
no-ops; memory counters 0, ``memory_stats``   ``report_memory``, ``training_log``
``{}`` (zeros)
``torch.accelerator.current_stream`` no-op    torch's optimizers check it for graph capture
``torch._dynamo.config.disable = True``       ``pretrain()`` warms up Megatron's
                                              torch.compile'd fusions (GPU kernels); they
                                              run eagerly instead
============================================  =============================================

Everything replaced is put back when the block ends (``install_cuda_shim``
returns the originals; ``restore_cuda_shim`` puts them back).

``train_step`` is the tests' oracle loop (not used by the launch): zero the DDP
grad buffers, Megatron's ``forward_backward_func`` with ``finalize_model_grads``,
then a plain torch optimizer on ``main_grad`` (SGD keeps the comparison exact).
"""

from __future__ import annotations

import collections
import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.overrides import TorchFunctionMode

from dsp_plugin.megatron.steps import forward_step

__all__ = ["cuda_shim", "install_cuda_shim", "restore_cuda_shim", "train_step", "wrap_ddp"]


class _NoStream:
    """Stands in for a CUDA stream on CPU, where all work is synchronous."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def is_capturing(self) -> bool:
        return False


def _device_properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(major=9, minor=0, name="cpu (dsp_plugin cuda_shim)", total_memory=0)


_SHIMS = {
    "current_device": lambda: torch.device("cpu"),
    "current_stream": lambda device=None: _NoStream(),
    "get_device_properties": _device_properties,
    "synchronize": lambda device=None: None,
    "Stream": lambda *args, **kwargs: _NoStream(),
    "stream": lambda stream=None: contextlib.nullcontext(),
    # there is no CUDA generator on CPU: nothing to save, nothing to restore
    "get_rng_state": lambda device="cuda": torch.empty(0, dtype=torch.uint8),
    "set_rng_state": lambda new_state, device="cuda": None,
}

_ZERO_BYTES = lambda device=None: 0  # noqa: E731 (no device memory is in use on CPU)

_TRAINING_SHIMS = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "set_device": lambda device: None,
    "empty_cache": lambda: None,
    "reset_peak_memory_stats": lambda device=None: None,
    "memory_stats": lambda device=None: collections.defaultdict(int),
    "memory_allocated": _ZERO_BYTES, "max_memory_allocated": _ZERO_BYTES,
    "memory_reserved": _ZERO_BYTES, "max_memory_reserved": _ZERO_BYTES, "device_memory_used": _ZERO_BYTES,
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Maps ``device="cuda"`` (and CUDA ordinals) in torch calls to the CPU; ``Tensor.cuda()`` and
    ``Tensor.pin_memory()`` (the data loader pins when ``is_available()`` answers True) are no-ops."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:  # pinned memory: for CUDA copies
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MODE: list[_CudaTensorsOnCpu] = []


def cuda_is_real() -> bool:
    """Whether this process has CUDA: ``torch.cuda.is_available()``, unless it is this shim answering (training).

    Asked each time, not remembered from the process's first call: a test that gives the process a
    (fake) GPU for a while must not leave the answer behind for the CPU tests after it.
    """
    return torch.cuda.is_available is not _TRAINING_SHIMS["is_available"] and torch.cuda.is_available()


def install_cuda_shim(*, training: bool = False) -> dict[str, Any]:
    """Install the shim (the CPU path, also where CUDA is present); returns what it replaced.

    ``training=True`` adds the queries of ``megatron.training``'s ``pretrain()``/``train()``
    (``torch.cuda.is_available()`` answers True while it is installed). A launch that should use
    the GPU when there is one asks ``cuda_is_real()`` first, as ``pretrain_stdit`` does.
    """
    replaced = {}
    shims = {**_SHIMS, **(_TRAINING_SHIMS if training else {})}
    for name, shim in shims.items():
        if getattr(torch.cuda, name) is not shim:
            replaced[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, shim)
    for name in ("get_rng_state", "set_rng_state"):  # activation recompute calls torch.cuda.random.*
        if getattr(torch.cuda.random, name) is not _SHIMS[name]:
            replaced[f"random.{name}"] = getattr(torch.cuda.random, name)
            setattr(torch.cuda.random, name, _SHIMS[name])
    if training and torch.accelerator.current_stream is not _SHIMS["current_stream"]:
        # torch's optimizers check for graph capture on the accelerator's stream once CUDA is "available"
        replaced["accelerator.current_stream"] = torch.accelerator.current_stream
        torch.accelerator.current_stream = _SHIMS["current_stream"]
    if training and not torch._dynamo.config.disable:
        # Megatron's fusions are torch.compile'd GPU kernels (pretrain() warms them up); with
        # is_available() answering True, dynamo would try to initialise CUDA: run them eagerly
        torch._dynamo.config.disable = True
        replaced["_dynamo_disable"] = False
    if not _MODE:
        _MODE.append(_CudaTensorsOnCpu())
        _MODE[0].__enter__()
        replaced["_mode"] = _MODE[0]
    return replaced


def restore_cuda_shim(replaced: dict[str, Any]) -> None:
    """Put back what ``install_cuda_shim`` replaced."""
    for name, original in replaced.items():
        if name == "_mode":
            _MODE.pop().__exit__(None, None, None)
        elif name == "_dynamo_disable":
            torch._dynamo.config.disable = original
        elif name.startswith("random."):
            setattr(torch.cuda.random, name.split(".", 1)[1], original)
        elif name == "accelerator.current_stream":
            torch.accelerator.current_stream = original
        else:
            setattr(torch.cuda, name, original)


@contextlib.contextmanager
def cuda_shim(*, training: bool = False) -> Iterator[None]:
    """``install_cuda_shim`` for the duration of a block, restored afterwards."""
    replaced = install_cuda_shim(training=training)
    try:
        yield
    finally:
        restore_cuda_shim(replaced)


def wrap_ddp(model: torch.nn.Module, config: TransformerConfig, *, bucket_size: int | None = None,
             ) -> DistributedDataParallel:
    """Megatron DDP as ``get_model`` builds it; gradients average over DP x CP (= DP x DSP)."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False, bucket_size=bucket_size)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def train_step(model: list[DistributedDataParallel], data_iterator: Any, optimizer: torch.optim.Optimizer, *,
               num_microbatches: int, micro_batch_size: int, seq_length: int) -> tuple[float, float] | None:
    """One step with a plain torch optimizer (the tests' oracle loop).

    Returns this rank's reported ``(value, count)`` summed over micro-batches on the
    last stage, else None; the loss is ``sum(value) / sum(count)`` over all ranks
    (what ``megatron.training``'s ``train_step`` computes with an all-reduce).
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=False)
    for chunk in model:  # what Megatron's optimizer does first: use the reduced main_grad
        for param in chunk.module.parameters():
            param.grad = param.main_grad.to(param.dtype)
    optimizer.step()
    if not losses:
        return None
    value, count = torch.stack([entry["loss"].float() for entry in losses]).sum(dim=0).tolist()
    return value, count
