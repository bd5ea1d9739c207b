"""DSP for diffusers' ``LatteTransformer3DModel``: the built-in plan, with a frame-sharded entry for sampling.

``LatteDSP(model, group=g)`` parallelizes the model with ``LATTE_PLAN``
(``dsp_plugin.plan.builtin``; hooks, the model's own forward, in place) and adds
what a sampler needs:

    forward(x)              split frames -> the model on its shard -> gather frames  (replicated in and out)
    forward_shard(x_local)  the model on this rank's frames, output frames kept sharded (no gather)

Both run the model under ``dsp_plugin.plan.sharded_io``: the tokens are split on
frames, a spatial block runs on its local frames, a switch after it moves the
shard to patches for the temporal block, and one more brings it back (two
all-to-alls per layer, none inside a block); the output stage runs on the local
frames. ``forward``'s input gradient is the full one on every rank (``comm.split``'s
backward gathers it), the parameters' gradients are partial (sum them over the
group: ``reduce_gradients``). The model's parameters are the adapter's, so
optimizers, DDP, ZeRO and ``save_pretrained`` see the unmodified model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin.adapters.sharded import check_divisible_lengths
from dsp_plugin.comm import gather, group_size, split

__all__ = ["LatteDSP"]


class LatteDSP(nn.Module):
    """A ``LatteTransformer3DModel`` parallelized over ``group`` with its built-in plan.

    On a model already parallelized with that plan the hooks are reused (over
    another group they are moved to this adapter's group; an adapter built
    before then refuses to run).
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        from diffusers import LatteTransformer3DModel

        from dsp_plugin.plan.builtin import LATTE_PLAN
        from dsp_plugin.plan.runtime import apply_plan, remove_plan

        if not isinstance(model, LatteTransformer3DModel):
            raise TypeError(f"LatteDSP: expected a diffusers LatteTransformer3DModel, got {type(model).__name__}")
        runtime = getattr(model, "_dsp_plan_runtime", None)
        if runtime is not None and runtime.plan is not LATTE_PLAN:
            raise ValueError("LatteDSP: the model is already parallelized with another plan than LATTE_PLAN; "
                             "expected an unparallelized model or one from dsp_plugin.parallelize(model)")
        if runtime is not None and runtime.group is not group:
            remove_plan(model)
            runtime = None
        self.model = apply_plan(model, LATTE_PLAN, group) if runtime is None else model
        self.group = group
        self._runtime = model._dsp_plan_runtime

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, enable_temporal_attentions: bool = True,
                return_dict: bool = True) -> Any:
        """Same contract as ``LatteTransformer3DModel.forward``; replicated in, replicated out."""
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        frames = hidden_states.shape[2] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else 0
        self._check_input("LatteDSP.forward", hidden_states, frames)
        from dsp_plugin.comm import agree_inputs
        from dsp_plugin.comm.group_resolution import _resolve_group
        from dsp_plugin.plan.runtime import INPUT_HINT

        agree_inputs("LatteDSP.forward", {"hidden_states": hidden_states, "timestep": timestep,
                                          "encoder_hidden_states": encoder_hidden_states,
                                          "encoder_attention_mask": encoder_attention_mask,
                                          "enable_temporal_attentions": enable_temporal_attentions},
                     group=_resolve_group(self.group, "LatteDSP"), hint=INPUT_HINT)
        local = split(hidden_states, 2, group=self.group)               # [B, C, T/N, H, W]
        out = self._on_shard(local, frames, timestep, encoder_hidden_states, encoder_attention_mask,
                             enable_temporal_attentions)
        output = gather(out, 2, group=self.group, global_len=frames)    # [B, C_out, T, H, W]
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def forward_shard(self, hidden_states: torch.Tensor, *, num_frames: int, timestep: torch.Tensor,
                      encoder_hidden_states: torch.Tensor,
                      encoder_attention_mask: torch.Tensor | None = None,
                      enable_temporal_attentions: bool = True) -> torch.Tensor:
        """This rank's frames ``[B, C, T_local, H, W]`` of a ``num_frames`` video -> its output frames."""
        self._check_input("LatteDSP.forward_shard", hidden_states, num_frames)
        return self._on_shard(hidden_states, num_frames, timestep, encoder_hidden_states, encoder_attention_mask,
                              enable_temporal_attentions)

    # ------------------------------------------------------------------------
    def _on_shard(self, latents: torch.Tensor, frames: int, *args: Any) -> torch.Tensor:
        from dsp_plugin.plan.frames import sharded_io

        if getattr(self.model, "_dsp_plan_runtime", None) is not self._runtime:
            raise RuntimeError("LatteDSP: the model has since been parallelized again (by another LatteDSP or "
                               "parallelize over another group); expected this adapter's hooks: wrap it again")
        with sharded_io(T=frames):
            return self.model(latents, *args, return_dict=False)[0]

    def _check_input(self, name: str, x: torch.Tensor, frames: int) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected hidden_states [B, C, T, H, W], got {shape}")
        p = self.model.config.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"{name}: height {x.shape[-2]} and width {x.shape[-1]} must be multiples of the "
                             f"patch size {p}")
        n = group_size(self.group)
        patches = (x.shape[-2] // p) * (x.shape[-1] // p)
        check_divisible_lengths(name, {"frames": frames, "patches (H*W/p^2)": patches}, n)
        video_length = self.model.config.video_length
        if frames > 1 and frames != video_length:
            raise ValueError(f"{name}: {frames} frames, but the model's temporal position embedding has "
                             f"video_length={video_length} (Latte adds it to all frames; expected equal)")
