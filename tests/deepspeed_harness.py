"""Shared pieces of the DeepSpeed tests: worker setup, the tiny STDiT, its data and a reference run.

Workers run under ``tests.distributed.run_distributed`` (gloo, CPU). DeepSpeed
wants the launcher's environment variables, and its CPU accelerator would
JIT-compile a shared-memory op (~30-60 s) that training never uses, so
``setup_worker`` sets the variables and ``dsp_plugin.deepspeed.initialize``
skips the op. Parameters travel back to the test as numpy arrays (tensors
would be shared through file descriptors that die with the worker).

The reference is the same model in one process on the whole global batch:
the oracle every parallel result is compared with (fp32).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from dsp_plugin import parallelize
from dsp_plugin.models import STDiT, STDiTConfig

LATENT = (4, 4, 4, 4)        # C, T, H, W: T=4 frames, S=(4/2)*(4/2)=4 tokens per frame
TEXT = (3, 16)               # text tokens, text_dim of the tiny preset
TOL = 1e-5                   # fp32, max abs over every parameter

Params = dict[str, np.ndarray]


def setup_worker(rank: int, world_size: int) -> None:
    """What ``deepspeed``/``torchrun`` would have exported, and quiet logs."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def make_model() -> STDiT:
    """The tiny STDiT with a fixed initialisation (same on every rank and in the reference)."""
    torch.manual_seed(0)
    return STDiT(STDiTConfig.preset("tiny"))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, ...]:
    """``size`` samples for ``step``: latents, timestep, text, target (deterministic)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(size, *LATENT, generator=g), torch.randint(0, 1000, (size,), generator=g),
            torch.randn(size, *TEXT, generator=g), torch.randn(size, *LATENT, generator=g))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    latents, timestep, text, target = batch
    return torch.nn.functional.mse_loss(model(latents, timestep, text), target)


def ds_config(stage: int, dsp: int, *, micro_batch: int, gas: int = 1, clip: float = 0.0,
              **extra: Any) -> dict[str, Any]:
    """A DeepSpeed config with the DSP key.

    Clipping is off unless asked for: DeepSpeed 0.19 clips at 1.0 by default,
    and a clipped SGD step hides a wrong gradient scale.
    """
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
            "sequence_parallel_mode": "dsp", "sequence_parallel_size": dsp, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, **extra}


def dsp_model() -> STDiT:
    """``make_model`` with the DSP hooks (group=None: the topology ``initialize`` installs)."""
    return parallelize(make_model())


def full_params(engine: Any) -> Params:
    """Every parameter of the engine's module (fp32 master copy when the optimizer keeps one).

    A collective under ZeRO-3: call on all ranks. ``safe_get_full_fp32_param``
    is DeepSpeed's public accessor for the optimizer's fp32 copy (bf16/fp16 and
    ZeRO 1-3); without one (fp32 ZeRO-0) the module parameter is the master.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.named_parameters())
    out = {}
    for name, p in params:
        master = safe_get_full_fp32_param(p)
        out[name] = (p if master is None else master).detach().float().clone().numpy()
    return out


def reference_run(steps: int, batch_size: int, *, lr: float, optimizer: str = "sgd") -> tuple[Params, list[float]]:
    """One process, whole global batch: parameters after ``steps`` and the loss per step."""
    torch.set_num_threads(1)
    model = make_model()
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, global_batch(step, batch_size))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().clone().numpy() for n, p in model.named_parameters()}, losses


def max_diff(a: Params, b: Params) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def update_ratio(after: Params, before: Params, reference_after: Params) -> float:
    """How large this run's update is relative to the reference's (1.0 = same; 0.5 = half)."""
    num = sum(float(np.sum((after[k] - before[k]) * (reference_after[k] - before[k]))) for k in before)
    den = sum(float(np.sum((reference_after[k] - before[k]) ** 2)) for k in before)
    return num / den
