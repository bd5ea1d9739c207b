"""Initialise parameters identically for every TP x DSP x PP layout of the same model.

Megatron seeds each pipeline stage differently and initialises in construction
order, so a PP=2 run and a single-process run start from different weights.
For a run that must be comparable across layouts (tests, the loss curves in
the docs), every parameter is drawn instead from a generator keyed by its
*global* name (layer index including the pipeline offset), as a full tensor,
and this rank keeps its tensor-parallel chunk (``partition_dim``, as Megatron
marks TP parameters). The result does not depend on TP, DSP, DP or PP.
"""

from __future__ import annotations

import re
import zlib

import torch
from megatron.core import parallel_state as ps
from torch import nn

__all__ = ["global_parameter_name", "init_like_single_process"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_parameter_name(name: str, layer_offset: int) -> str:
    """``layers.{i}.x`` -> ``layers.{i + layer_offset}.x`` (the name in the single-process model)."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


def _full_shape_and_dim(param: nn.Parameter, tp: int) -> tuple[list[int], int | None]:
    shape = list(param.shape)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return shape, None
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError("init_like_single_process: strided TP partitions (gated MLPs) are not supported")
    dim = param.partition_dim
    shape[dim] *= tp
    return shape, dim


@torch.no_grad()
def init_like_single_process(model: nn.Module, *, seed: int, layer_offset: int = 0) -> None:
    """Overwrite every parameter with a layout-independent draw (see the module docstring).

    Norm weights get ``1 + 0.1 * N(0, 1)``, matrices ``N(0, 1/fan_in)``, everything
    else ``0.1 * N(0, 1)``: non-trivial values, so every gradient is exercised.
    """
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, param in model.named_parameters():
        key = global_parameter_name(name, layer_offset)
        shape, dim = _full_shape_and_dim(param, tp)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        full = torch.randn(shape, generator=gen, dtype=torch.float32)
        if "norm" in key and key.endswith("weight"):
            full = 1.0 + 0.1 * full
        elif len(shape) == 2 and "pos" not in key:
            full = full / shape[1] ** 0.5
        else:
            full = 0.1 * full
        local = full if dim is None else full.chunk(tp, dim=dim)[tp_rank]
        param.copy_(local.to(dtype=param.dtype, device=param.device))
