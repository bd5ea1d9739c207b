"""Which torch.distributed backend and device a launch or bench runs on: chosen here and nowhere else.

NCCL and the process's local GPU (``LOCAL_RANK``, as torchrun, the DeepSpeed launcher
and Slurm's ``srun`` wrappers set it) when CUDA is present; gloo and the CPU otherwise.
``DSP_BACKEND=gloo`` keeps a CUDA machine on the CPU (the CI path); ``DSP_BACKEND=nccl``
insists on GPUs and fails with the reason when there are none.

    from dsp_plugin import backend
    rt = backend.init_distributed()          # under torchrun: init_process_group(rt.backend), set the GPU
    model.to(rt.device)

``choose`` takes the availability as arguments, so the choice is tested on a CPU machine.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ENV", "Runtime", "choose", "current_device", "init_distributed", "synchronize"]

ENV = "DSP_BACKEND"
_BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class Runtime:
    """A backend for ``init_process_group`` and the device this process computes on."""

    backend: str
    device: torch.device

    def describe(self) -> str:
        return f"{self.backend} on {self.device}"


def choose(*, local_rank: int | None = None, cuda_available: bool | None = None, device_count: int | None = None,
           env: Mapping[str, str] | None = None) -> Runtime:
    """The backend and device for this process; CUDA figures default to ``torch.cuda``'s.

    ``local_rank`` defaults to ``$LOCAL_RANK`` (0 without a launcher). Raises
    ``ValueError`` naming the value for an unknown ``DSP_BACKEND``, for ``nccl``
    without CUDA, and for a local rank with no GPU of its own.
    """
    env = os.environ if env is None else env
    wanted = env.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in _BACKENDS:
        raise ValueError(f"{ENV}={env.get(ENV)!r}: expected one of {', '.join(_BACKENDS)}")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if wanted == "gloo" or (wanted == "auto" and not cuda_available):
        return Runtime("gloo", torch.device("cpu"))
    if not cuda_available:
        raise ValueError(f"{ENV}=nccl: NCCL needs CUDA, and torch.cuda.is_available() is False "
                         f"(unset {ENV} or set it to gloo to run on the CPU)")
    if local_rank is None:
        local_rank = int(env.get("LOCAL_RANK", "0"))
    if device_count is None:
        device_count = torch.cuda.device_count()
    if not 0 <= local_rank < device_count:
        raise ValueError(f"LOCAL_RANK={local_rank}: this node has {device_count} GPU(s) (cuda:0..{device_count - 1}); "
                         f"start at most {device_count} processes per node (--nproc-per-node)")
    return Runtime("nccl", torch.device("cuda", local_rank))


def init_distributed(*, timeout_s: float = 120, **init_kwargs: object) -> Runtime:
    """``choose()``, bind the GPU, then ``init_process_group`` from the launcher's environment.

    Call it in a process started by torchrun / ``deepspeed`` / ``srun`` (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` set); ``init_kwargs`` go to ``init_process_group``
    (a ``store``, ``rank``, ``world_size`` for a launcher of your own).
    """
    import torch.distributed as dist

    rt = choose(local_rank=init_kwargs.pop("local_rank", None))  # type: ignore[arg-type]
    if rt.device.type == "cuda":
        torch.cuda.set_device(rt.device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(rt.backend, timeout=timeout, **init_kwargs)  # type: ignore[arg-type]
    return rt


def current_device() -> torch.device:
    """The device of this process's default group: its GPU under NCCL, else the CPU.

    torch's ``fake`` backend (Megatron's ``--fake-process-group``, the fake-device tests) stands in for
    NCCL on a machine with CUDA: the GPU there too.
    """
    import torch.distributed as dist

    if dist.is_initialized() and (dist.get_backend() == "nccl"
                                  or (dist.get_backend() == "fake" and torch.cuda.is_available())):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host timer measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
