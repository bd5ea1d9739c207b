"""DSP for diffusers' ``LatteTransformer3DModel``, without editing diffusers.

Latte's own forward reshapes between ``[B*T, S, D]`` (spatial blocks) and
``[B*S, T, D]`` (temporal blocks) with the global frame count, so hooks cannot
shard it. ``LatteDSP`` re-expresses that forward around the model's own
modules (``pos_embed``, ``adaln_single``, ``caption_projection``, the two block
lists, ``norm_out``/``proj_out``), in the order and with the arithmetic of
diffusers 0.42, keeping the tokens as a ``Sharded`` ``[B, T, S, D]``:

    latents [B, C, T, H, W]  --split T-->  [B, C, T/N, H, W]   (frames are patch-embedded independently)
    spatial block i   on fold(S): [B*T/N, S, D]                 local, no communication
    temporal block i  switch T->S, fold(T): [B*S/N, T, D]       one all-to-all
    next spatial      switch S->T                               one all-to-all
    output stage      per frame on S(T), unpatchify local frames
    exit              gather T (``forward``) or keep the shard (``forward_shard``, for sampling)

Two all-to-alls per layer, none inside a block, no gather between diffusion
steps. The wrapped model is ``.model``; its parameters are the adapter's, so
optimizers, DDP, ZeRO and ``save_pretrained`` see the unmodified model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin.adapters.sharded import Sharded, check_divisible_lengths
from dsp_plugin.comm import gather, group_size, split

__all__ = ["LatteDSP"]

T_DIM, S_DIM = 1, 2  # sequence dims of the token layout [B, T, S, D]


class LatteDSP(nn.Module):
    """A ``LatteTransformer3DModel`` whose forward shards frames and patches over ``group``.

    ``forward`` takes and returns full tensors (same signature and output type as
    the model: a drop-in for training). ``forward_shard`` takes and returns this
    rank's frame shard of ``[B, C, T, H, W]`` (for samplers that keep the latents
    sharded across the whole denoising loop).
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        from diffusers import LatteTransformer3DModel

        if not isinstance(model, LatteTransformer3DModel):
            raise TypeError(f"LatteDSP: expected a diffusers LatteTransformer3DModel, got {type(model).__name__}")
        self.model = model
        self.group = group

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

        self._check_input("LatteDSP.forward", hidden_states, hidden_states.shape[2])
        frames = hidden_states.shape[2]
        local = split(hidden_states, 2, group=self.group)               # [B, C, T/N, H, W]
        out = self._sharded_forward(local, frames, timestep, encoder_hidden_states, encoder_attention_mask,
                                    enable_temporal_attentions)
        output = gather(out, 2, group=self.group, global_len=frames)    # [B, C_out, T, H, W]
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def forward_shard(self, hidden_states: torch.Tensor, *, num_frames: int, timestep: torch.Tensor,
                      encoder_hidden_states: torch.Tensor,
                      encoder_attention_mask: torch.Tensor | None = None,
                      enable_temporal_attentions: bool = True) -> torch.Tensor:
        """This rank's frames ``[B, C, T_local, H, W]`` of a ``num_frames`` video -> its output frames."""
        self._check_input("LatteDSP.forward_shard", hidden_states, num_frames)
        return self._sharded_forward(hidden_states, num_frames, timestep, encoder_hidden_states,
                                     encoder_attention_mask, enable_temporal_attentions)

    # ------------------------------------------------------------------------
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

    def _run(self, block: nn.Module, *args: Any) -> torch.Tensor:
        """A block call, under the model's own gradient checkpointing when it is enabled."""
        if torch.is_grad_enabled() and self.model.gradient_checkpointing:
            return self.model._gradient_checkpointing_func(block, *args)
        return block(*args)

    def _sharded_forward(self, latents: torch.Tensor, frames: int, timestep: torch.Tensor | None,
                         encoder_hidden_states: torch.Tensor | None,
                         encoder_attention_mask: torch.Tensor | None,
                         enable_temporal_attentions: bool) -> torch.Tensor:
        m = self.model
        p = m.config.patch_size
        batch, channels, local_frames, height, width = latents.shape
        h, w = height // p, width // p
        # [B, C, T/N, H, W] -> [B*T/N, C, H, W] -> patch tokens [B*T/N, S, D] -> [B, T/N, S, D]
        tokens = m.pos_embed(latents.permute(0, 2, 1, 3, 4).reshape(-1, channels, height, width))
        seq = Sharded.wrap(tokens.view(batch, local_frames, h * w, tokens.shape[-1]),
                           lengths=(frames, h * w), shard=T_DIM, group=self.group)

        added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
        timestep, embedded_timestep = m.adaln_single(timestep, added_cond_kwargs=added_cond_kwargs,
                                                     batch_size=batch, hidden_dtype=tokens.dtype)
        text = m.caption_projection(encoder_hidden_states)             # [B, N_text, D]

        for i, (spatial, temporal) in enumerate(zip(m.transformer_blocks, m.temporal_transformer_blocks)):
            seq = seq.attend(S_DIM)                                     # S(S) -> S(T) unless already on T
            rows = seq.rows_per_sample(S_DIM)                           # local frames
            y = self._run(spatial, seq.fold(S_DIM), None, text.repeat_interleave(rows, dim=0),
                          encoder_attention_mask, timestep.repeat_interleave(rows, dim=0), None, None)
            seq = seq.unfold(y, S_DIM)
            if not enable_temporal_attentions:
                continue
            seq = seq.attend(T_DIM)                                     # S(T) -> S(S)
            folded = seq.fold(T_DIM)                                    # [B*S/N, T, D]
            if i == 0 and frames > 1:
                folded = folded + m.temp_pos_embed.to(folded.dtype)
            y = self._run(temporal, folded, None, None, None,
                          timestep.repeat_interleave(seq.rows_per_sample(T_DIM), dim=0), None, None)
            seq = seq.unfold(y, T_DIM)

        # output stage is per frame (modulation by the per-sample embedding, unpatchify)
        seq = seq.attend(S_DIM)                                         # back to S(T)
        x = seq.fold(S_DIM)                                             # [B*T/N, S, D]
        embedded = embedded_timestep.repeat_interleave(local_frames, dim=0)
        shift, scale = (m.scale_shift_table[None] + embedded[:, None]).chunk(2, dim=1)
        x = m.proj_out(m.norm_out(x) * (1 + scale) + shift)            # [B*T/N, S, p*p*C_out]
        x = x.reshape(-1, h, w, p, p, m.out_channels)
        x = torch.einsum("nhwpqc->nchpwq", x).reshape(-1, m.out_channels, h * p, w * p)
        # [B*T/N, C_out, H, W] -> [B, C_out, T/N, H, W]
        return x.reshape(batch, local_frames, *x.shape[1:]).permute(0, 2, 1, 3, 4)
