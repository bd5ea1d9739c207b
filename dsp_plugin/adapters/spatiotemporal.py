"""DSP for diffusers' ``TransformerSpatioTemporalModel`` (Stable Video Diffusion's factorized transformer).

The model is parallelized by its built-in plan, ``SVD_PLAN`` (``dsp_plugin.plan.builtin``),
with hooks: ``dsp_plugin.parallelize(model)`` returns the model itself. Every block
runs on ``[B*F, S, D]``:

    proj_in output: split F                                   no communication
    spatial block on its frames, then switch F -> S           one all-to-all
    + frame embedding, temporal block on its pixels            (it folds itself with the global num_frames)
        (its frame-0 text context: built by the model from the replicated input, split with the pixels)
    time mixer per (b, f, pixel); next spatial block: switch S -> F   one all-to-all
    proj_out input: gather S                                  one all_gather

``SpatioTemporalDSP(model, group=g)`` is kept as a name for the same thing, a
module wrapping the parallelized model (``.model``). Gradients follow the
project's convention: every gradient, the input's too, is the sum over the group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["SpatioTemporalDSP"]


class SpatioTemporalDSP(nn.Module):
    """A ``TransformerSpatioTemporalModel`` parallelized over ``group`` with ``SVD_PLAN``; same call signature."""

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

        from dsp_plugin.plan.builtin import SVD_PLAN
        from dsp_plugin.plan.runtime import apply_plan

        if not isinstance(model, TransformerSpatioTemporalModel):
            raise TypeError(f"SpatioTemporalDSP: expected a diffusers TransformerSpatioTemporalModel, got "
                            f"{type(model).__name__}")
        runtime = getattr(model, "_dsp_plan_runtime", None)
        if runtime is None:
            apply_plan(model, SVD_PLAN, group)
        elif runtime.plan is not SVD_PLAN or runtime.group is not group:
            raise ValueError("SpatioTemporalDSP: the model is already parallelized (another plan or group); "
                             "expected an unparallelized model or one from dsp_plugin.parallelize(model)")
        self.model, self.group = model, group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Same contract as ``TransformerSpatioTemporalModel.forward``; replicated in, replicated out."""
        return self.model(*args, **kwargs)
