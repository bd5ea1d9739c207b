"""DSP for diffusers' ``TransformerSpatioTemporalModel`` (Stable Video Diffusion's factorized transformer).

The second model family, written with the same recipe as ``latte.py``. Input
``[B*F, C, H, W]`` with ``image_only_indicator [B, F]`` and per-frame
``encoder_hidden_states [B*F, N, Dc]``; tokens kept as ``Sharded [B, F, S, D]``:

    split F; per-frame GroupNorm + proj_in                   local
    spatial block on fold(S) [B*F/N, S, D]                   local
    switch F->S; + frame embedding; temporal block           one all-to-all
        (the block folds itself: it takes [B*F, S/N, D] and the GLOBAL num_frames)
    time_mixer per (b, f), on S(S) where all frames are local
    next spatial: switch S->F; output: switch S->F, proj_out, + residual, gather F

Beyond the recipe this family needed: (1) a temporal block that reshapes
internally with ``num_frames`` (passed the global count, fed the spatial-style
fold of the S shard); (2) per-frame conditioning split with the frames; (3) the
temporal cross-attention context is taken from frame 0, which after the split
only rank 0 holds, so it is computed from the replicated input first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin.adapters.sharded import Sharded, check_divisible_lengths
from dsp_plugin.comm import gather, group_size, split

__all__ = ["SpatioTemporalDSP"]

F_DIM, S_DIM = 1, 2


class SpatioTemporalDSP(nn.Module):
    """A ``TransformerSpatioTemporalModel`` whose forward shards frames and pixels over ``group``."""

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

        if not isinstance(model, TransformerSpatioTemporalModel):
            raise TypeError(f"SpatioTemporalDSP: expected a diffusers TransformerSpatioTemporalModel, got "
                            f"{type(model).__name__}")
        self.model = model
        self.group = group

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                image_only_indicator: torch.Tensor | None = None, return_dict: bool = True) -> Any:
        """Same contract as ``TransformerSpatioTemporalModel.forward``; replicated in, replicated out."""
        from diffusers.models.transformers.transformer_temporal import TransformerTemporalModelOutput

        m = self.model
        if image_only_indicator is None or encoder_hidden_states is None:
            raise ValueError("SpatioTemporalDSP: image_only_indicator [B, F] and encoder_hidden_states "
                             "[B*F, N, D] are required (as in the model)")
        batch_frames, channels, height, width = hidden_states.shape
        frames = image_only_indicator.shape[-1]
        batch = batch_frames // frames
        check_divisible_lengths("SpatioTemporalDSP", {"frames": frames, "pixels (H*W)": height * width},
                                group_size(self.group))

        # frame 0's text per sample, for the temporal cross-attention: from the replicated input
        first = encoder_hidden_states.reshape(batch, frames, -1, encoder_hidden_states.shape[-1])[:, 0]

        # [B*F, C, H, W] -> [B, F/N, C, H, W]; per-frame conditioning split the same way
        x = split(hidden_states.reshape(batch, frames, channels, height, width), F_DIM, group=self.group)
        local_frames = x.shape[1]
        text = split(encoder_hidden_states.reshape(batch, frames, *encoder_hidden_states.shape[1:]), F_DIM,
                     group=self.group).flatten(0, 1)                  # [B*F/N, N, Dc]
        residual = x
        h = m.norm(x.flatten(0, 1))                                   # GroupNorm: per (b, f)
        h = m.proj_in(h.permute(0, 2, 3, 1).reshape(batch * local_frames, height * width, channels))
        seq = Sharded.wrap(h.view(batch, local_frames, height * width, h.shape[-1]),
                           lengths=(frames, height * width), shard=F_DIM, group=self.group)

        frame_ids = torch.arange(frames, device=h.device).repeat(batch)
        emb = m.time_pos_embed(m.time_proj(frame_ids).to(dtype=h.dtype))  # [B*F, D]
        emb = emb.view(batch, frames, 1, -1)

        for block, temporal_block in zip(m.transformer_blocks, m.temporal_transformer_blocks):
            seq = seq.attend(S_DIM)                                   # S(S) -> S(F) unless already
            folded = seq.fold(S_DIM)                                  # [B*F/N, S, D]
            if torch.is_grad_enabled() and m.gradient_checkpointing:
                y = m._gradient_checkpointing_func(block, folded, None, text, None)
            else:
                y = block(folded, encoder_hidden_states=text)
            seq = seq.unfold(y, S_DIM)

            seq = seq.attend(F_DIM)                                   # S(F) -> S(S): [B, F, S/N, D]
            local_pixels = seq.local_len(S_DIM)
            spatial = seq.tensor.reshape(batch * frames, local_pixels, -1)
            context = first[:, None].broadcast_to(batch, local_pixels, *first.shape[1:])
            mixed = temporal_block((seq.tensor + emb).reshape(batch * frames, local_pixels, -1),
                                   num_frames=frames, encoder_hidden_states=context.reshape(
                                       batch * local_pixels, *first.shape[1:]))
            out = m.time_mixer(x_spatial=spatial, x_temporal=mixed, image_only_indicator=image_only_indicator)
            seq = replace(seq, tensor=out.view(seq.tensor.shape))

        seq = seq.attend(S_DIM)                                       # back to S(F) for per-frame output
        y = m.proj_out(seq.fold(S_DIM))                               # [B*F/N, S, C]
        y = y.reshape(batch * local_frames, height, width, channels).permute(0, 3, 1, 2)
        y = y.reshape(batch, local_frames, channels, height, width) + residual
        output = gather(y.contiguous(), F_DIM, group=self.group, global_len=frames).flatten(0, 1)
        return TransformerTemporalModelOutput(sample=output) if return_dict else (output,)
