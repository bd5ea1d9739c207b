"""Spatial-temporal video DiT: embeddings + a stock megatron-core ``TransformerBlock`` of DSP layers + head.

The same architecture as the plain-torch reference ``dsp_plugin.models.stdit.STDiT``
(patch size 1, two axes), so its weights load here (``weights.py``). Shapes per
micro-batch (``N`` the DSP size)::

    latents [B, C, T, H, W] -> tokens [B, T, S, C] -> split on entry_shard_dim -> [B, T/N, S, C]
    -> patch embed -> [T/N * S, B, D]  (Megatron's layout)     c = t_embed(timestep) [B, D]
                                                              text -> text_proj -> [L, B, D]
    -> TransformerBlock(DSPSpatialTemporalLayer x num_layers; each switches when it must)
    -> head: norm, adaLN (shift, scale from c), Linear -> [B, T_x, S_x, C] on the local shard

The geometry ``(T, H, W)`` is each batch's own (buckets of frames and resolution
change between batches without a restart): every stage reads it from the
batch's latents, tags the hidden states it hands to the block with it
(:func:`~dsp_plugin.megatron.dsp_layer.attach_video_grid`) and builds the RoPE
tables from it. OpenSora 1.2's features follow Megatron's flags: RoPE
(``--position-embedding-type rope``), q/k norms (``--qk-layernorm``), caption
masks (``text_mask``, from the batch), and adaLN-single (``dsp_adaln_single``:
one ``t_block`` here, a ``scale_shift_table`` per layer and in the head).

``TransformerBlock`` drives the layers, so full/selective recompute,
``sharded_state_dict`` with pipeline offsets, FP8 contexts and the RNG fork are
Megatron's own. The split at the entry only touches data, and every later op is
per token or a layer on a shard, so each rank's parameter gradient is the partial
sum over its tokens; Megatron's CP loss scaling and DDP averaging over DP x CP
make that SUM over DSP, MEAN over DP (``steps.loss_func``).

Pipeline: every stage needs the conditioning and the text. A non-last stage sends
``cat([hidden [n, B, D], c [1, B, D], (t_block output [6, B, D]), text [L, B, D]])``
as its one ``[s, B, D]`` tensor and the next stage slices it (gradients flow back
through the same p2p path); ``variable_seq_lengths`` carries the uneven DSP shards
and the changing buckets. The caption mask and the geometry come from each
stage's own batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from dsp_plugin.comm import split
from dsp_plugin.megatron.config import (
    DSPTransformerConfig,
    entry_shard_dim,
    input_shard_dim,
    local_grid,
    output_shard_dim,
)
from dsp_plugin.megatron.dsp_layer import attach_video_grid
from dsp_plugin.megatron.rope import video_rope

__all__ = ["STDiTMegatron", "VideoShape", "timestep_features"]

FREQ_DIM = 256  # timestep features, as the reference's TimestepEmbedder


@dataclass(frozen=True)
class VideoShape:
    """Latent video geometry of one sample: channels, frames, height, width (patch size 1).

    The model fixes only ``channels``; frames, height and width are each batch's own.
    """

    channels: int
    frames: int
    height: int
    width: int

    @property
    def patches(self) -> int:
        return self.height * self.width

    @property
    def tokens(self) -> int:
        return self.frames * self.patches


def timestep_features(timestep: torch.Tensor, dim: int = FREQ_DIM) -> torch.Tensor:
    """Sinusoidal features ``[B] -> [B, dim]`` in fp32 (``cos`` then ``sin``, as the reference)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    angles = timestep.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class STDiTMegatron(MegatronModule):
    """One pipeline stage; ``forward(latents, timestep, text=None)``; DSP over ``pg_collection.cp``."""

    def __init__(self, config: DSPTransformerConfig, spec: ModuleSpec, video: VideoShape, *,
                 text_dim: int | None = None, text_len: int = 0, pre_process: bool = True,
                 post_process: bool = True, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self.video, self.pre_process, self.post_process = video, pre_process, post_process
        self.text_dim, self.text_len = text_dim, text_len if text_dim else 0
        self.input_tensor: torch.Tensor | None = None
        self.share_embeddings_and_output_weights = False  # nothing tied across stages
        hidden, dtype = config.hidden_size, config.params_dtype
        if pre_process:
            self.patch_embed = nn.Linear(video.channels, hidden, dtype=dtype)
            self.time_embed = nn.Sequential(nn.Linear(FREQ_DIM, hidden, dtype=dtype), nn.SiLU(),
                                            nn.Linear(hidden, hidden, dtype=dtype))
            self.text_proj = nn.Linear(text_dim, hidden, dtype=dtype) if text_dim else None
            if config.dsp_adaln_single:  # PixArt: one modulation for every layer
                self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden, dtype=dtype))
        self.decoder = TransformerBlock(config, spec, post_layer_norm=False, pre_process=pre_process,
                                        post_process=post_process, pg_collection=self.pg_collection)
        if post_process:
            self.final_norm = nn.LayerNorm(hidden, eps=config.layernorm_epsilon, elementwise_affine=False)
            if config.dsp_adaln_single:  # PixArt's final layer: a table plus the timestep embedding
                self.final_scale_shift_table = nn.Parameter(torch.randn(2, hidden, dtype=dtype) / hidden**0.5)
            else:
                self.final_adaln = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden, dtype=dtype))
            self.head = nn.Linear(hidden, video.channels, dtype=dtype)

    @property
    def layer_offset(self) -> int:
        return self.decoder.layers[0].layer_number - 1 if len(self.decoder.layers) else 0

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Megatron's schedules hand the previous stage's packed output here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _local_tokens(self, grid: tuple[int, int], shard_dim: int) -> int:
        group = self.pg_collection.cp
        frames, patches = local_grid(grid, shard_dim, group.size(), group.rank())
        return frames * patches

    def _geometry(self, latents: torch.Tensor | None) -> tuple[int, int, int]:
        """``(T, H, W)`` of this batch: every stage reads it from its own batch (it cannot ride the p2p)."""
        if latents is None or latents.dim() != 5 or latents.shape[1] != self.video.channels:
            raise ValueError(f"STDiTMegatron: every pipeline stage needs the batch's latents [B, "
                             f"{self.video.channels}, T, H, W] for its geometry, got "
                             f"{None if latents is None else tuple(latents.shape)}")
        return latents.shape[2], latents.shape[3], latents.shape[4]

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor | None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> hidden ``[n_local, B, D]`` (tagged), ``c [B, D]`` (``[B, 7D]`` = ``c`` and the t_block output
        with adaLN-single), text ``[L, B, D]`` or None (first stage)."""
        batch, channels, frames, height, width = latents.shape
        tokens = latents.permute(0, 2, 3, 4, 1).reshape(batch, frames, height * width, channels)
        # data: no gradient flows back; the tokens become [B, T_x, S_x, C] on this DSP rank
        shard = entry_shard_dim(self.config)
        tokens = split(tokens, shard, group=self.pg_collection.cp)
        # [B, T_x, S_x, C] -> [T_x, S_x, B, C] -> [T_x, S_x, B, D] -> [T_x*S_x, B, D], contiguous (the reorder is
        # on the C-wide input; Megatron's checkpoint with --distribute-saved-activations flattens its input)
        x = self.patch_embed(tokens.to(self.patch_embed.weight.dtype).permute(1, 2, 0, 3))
        hidden = x.reshape(-1, batch, x.shape[-1])
        weight = self.time_embed[0].weight
        cond = self.time_embed(timestep_features(timestep, FREQ_DIM).to(weight.dtype))
        if self.config.dsp_adaln_single:
            cond = torch.cat([cond, self.t_block(cond)], dim=-1)
        if self.text_proj is not None:
            if text is None:
                raise ValueError("STDiTMegatron: the model has cross-attention (text_dim="
                                 f"{self.text_dim}) but no text was given")
            text = self.text_proj(text.to(self.text_proj.weight.dtype)).transpose(0, 1)  # [B, L, D] -> [L, B, D]
        return attach_video_grid(hidden, (frames, height * width), shard), cond, text

    def forward(self, latents: torch.Tensor | None, timestep: torch.Tensor | None,
                text: torch.Tensor | None = None, text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last stage: ``[B, T_x, S_x, C]`` on the local shard; other stages the packed activation.

        ``text_mask [B, L]`` bool (True: a caption token) masks the caption's padding in cross-attention.
        Every stage gets the batch's ``latents`` (for the geometry) and ``text_mask``.
        """
        frames, height, width = self._geometry(latents)
        grid = (frames, height * width)
        hidden_size = self.config.hidden_size
        cond_rows = 7 if self.config.dsp_adaln_single else 1
        if self.pre_process:
            hidden, cond, text = self.embed(latents, timestep, text)
        else:
            packed = self.input_tensor
            shard = input_shard_dim(self.config, self.layer_offset + 1)
            n = self._local_tokens(grid, shard)
            hidden = attach_video_grid(packed[:n], grid, shard)
            cond = packed[n:n + cond_rows].transpose(0, 1).reshape(packed.shape[1], cond_rows * hidden_size)
            text = packed[n + cond_rows:] if self.text_len else None
            self.decoder.set_input_tensor(hidden)
        context_mask = None
        if text_mask is not None and text is not None:
            if text_mask.shape != (text.shape[1], text.shape[0]):
                raise ValueError(f"STDiTMegatron: text_mask {tuple(text_mask.shape)} must be [B, L] = "
                                 f"[{text.shape[1]}, {text.shape[0]}]")
            context_mask = ~text_mask.to(device=text.device, dtype=torch.bool)[:, None, None, :]
        layer_cond = cond[:, hidden_size:] if self.config.dsp_adaln_single else cond
        out = self.decoder(hidden_states=hidden, attention_mask=layer_cond, context=text,
                           context_mask=context_mask,
                           rotary_pos_emb=video_rope(self.config, frames, height, width, device=hidden.device))
        if not self.post_process:
            rows = cond.view(cond.shape[0], cond_rows, hidden_size).transpose(0, 1)  # [rows, B, D]
            parts = [out, rows] + ([text] if text is not None else [])
            return torch.cat(parts, dim=0)
        shard = output_shard_dim(self.config, self.config.num_layers)
        frames_l, patches_l = local_grid(grid, shard, self.pg_collection.cp.size(), self.pg_collection.cp.rank())
        x = out.view(frames_l, patches_l, out.shape[1], out.shape[2]).permute(2, 0, 1, 3)  # -> [B, T_x, S_x, D]
        c = cond[:, :hidden_size]
        if self.config.dsp_adaln_single:
            mods = (self.final_scale_shift_table[None] + c[:, None]).unbind(1)
        else:
            mods = self.final_adaln(c).chunk(2, dim=-1)
        shift, scale = (m[:, None, None] for m in mods)
        return self.head(self.final_norm(x) * (1 + scale) + shift)
