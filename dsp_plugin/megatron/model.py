"""Spatial-temporal DiT built from megatron-core TransformerLayers, with DSP between the stages.

Shapes (per micro-batch; ``B`` batch, ``C`` latent channels, ``T`` frames,
``S = H * W`` patches, ``D`` hidden; ``N`` the DSP size, ``T/N`` a local chunk)::

    latents [B, C, T, H, W] -> tokens [B, T, S, C] -> split S(1) -> [B, T/N, S, C] -> embed
    block 2k   spatial  (attends S):  input must be S(1);  layer sees [S, B*T/N, D]
    block 2k+1 temporal (attends T):  switch S(1)->S(2);   layer sees [T, B*S/N, D]
    ... a switch before every block whose attend dim is the sharded one ...
    head: per-token LayerNorm + Linear on the local shard -> [B, T/N or T, S/N or S, C]

The split at the entry only touches data (latents, targets), and every layer
that follows is either per-token or a TransformerLayer running on a shard, so
each rank's parameter gradient is the partial sum over the tokens it holds
(positional embeddings are sliced, not split, for the same reason). The loss is
the local share of the sample mean; the sum over the DSP group is the full loss.
Megatron multiplies it by the CP (= DSP) size and its DDP averages over DP x CP,
which nets out to SUM over DSP and MEAN over DP: the single-process gradient.

Pipeline parallelism: a stage that does not hold the first block receives, and a
stage that does not hold the head sends, the *sharded* activation flattened to
Megatron's ``[tokens_local, B, D]`` layout. The shard dim at a stage boundary
is fixed by the block pattern, so nothing else needs to travel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from dsp_plugin.comm import chunk_sizes, dynamic_switch, split
from dsp_plugin.megatron.layers import quantization_context

__all__ = ["STDiTMegatron", "VideoShape", "attend_dim", "shard_dim_after"]

FRAME_DIM, PATCH_DIM = 1, 2  # dims of the token tensor [B, T, S, D]


@dataclass(frozen=True)
class VideoShape:
    """Latent video geometry of one sample: channels, frames, height, width."""

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


def attend_dim(block: int) -> int:
    """Token dim block ``block`` attends along: even blocks spatial (S), odd blocks temporal (T)."""
    return PATCH_DIM if block % 2 == 0 else FRAME_DIM


def shard_dim_after(block: int) -> int:
    """Sharded token dim entering (and leaving) ``block``: the one it does not attend along.

    ``block = -1`` gives the placement right after the entry split (that of block 0).
    """
    return FRAME_DIM + PATCH_DIM - attend_dim(max(block, 0))


def _timestep_features(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of the diffusion timestep: [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = timestep.float()[:, None] * freqs.to(timestep.device)[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class STDiTMegatron(MegatronModule):
    """One pipeline stage of the spatial-temporal model; DSP over ``parallel_state``'s CP group.

    ``config.context_parallel_size`` must be 1 (attention is local); the DSP size is
    the size of Megatron's context-parallel group.
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, video: VideoShape, *,
                 pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("STDiTMegatron: config.context_parallel_size must be 1 under DSP (the DSP group "
                             f"sits in the CP slot of parallel_state), got {config.context_parallel_size}")
        pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        if config.num_layers % pp:
            raise ValueError(f"STDiTMegatron: num_layers ({config.num_layers}) is not divisible by "
                             f"pipeline model parallel size ({pp})")
        per_stage = config.num_layers // pp
        self.video, self.pre_process, self.post_process = video, pre_process, post_process
        self.layer_offset = pp_rank * per_stage
        self.input_tensor: torch.Tensor | None = None
        # nothing is tied across pipeline stages (finalize_model_grads asks)
        self.share_embeddings_and_output_weights = False
        hidden = config.hidden_size
        if pre_process:
            self.patch_embed = nn.Linear(video.channels, hidden)
            self.frame_pos = nn.Parameter(torch.zeros(video.frames, hidden))
            self.patch_pos = nn.Parameter(torch.zeros(video.patches, hidden))
            self.time_embed = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.layers = nn.ModuleList(
            build_module(spec, config=config, layer_number=self.layer_offset + i + 1) for i in range(per_stage))
        if post_process:
            self.final_norm = nn.LayerNorm(hidden, eps=config.layernorm_epsilon)
            self.head = nn.Linear(hidden, video.channels)

    # -- pipeline plumbing ---------------------------------------------------------------

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Megatron's schedules hand the previous stage's output here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def local_lengths(self, dim: int, batch: int) -> tuple[int, int, int]:
        """Local ``(B, T, S)`` of a token tensor sharded on ``dim`` on this DSP rank."""
        n, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        frames, patches = self.video.frames, self.video.patches
        if dim == FRAME_DIM:
            frames = chunk_sizes(frames, n)[rank]
        else:
            patches = chunk_sizes(patches, n)[rank]
        return batch, frames, patches

    def _from_pipeline(self, x: torch.Tensor) -> torch.Tensor:
        # [T_l * S_l, B, D] -> [B, T_l, S_l, D]
        _, frames, patches = self.local_lengths(shard_dim_after(self.layer_offset - 1), x.shape[1])
        return x.view(frames, patches, x.shape[1], x.shape[2]).permute(2, 0, 1, 3)

    @staticmethod
    def _to_pipeline(x: torch.Tensor) -> torch.Tensor:
        # [B, T_l, S_l, D] -> [T_l * S_l, B, D]; a tensor of its own (not a view), because
        # Megatron frees the storage of stage outputs once they are sent (deallocate_pipeline_outputs)
        out = x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[3])
        return out if out._base is None else out.clone()

    # -- forward ----------------------------------------------------------------------------

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """[B, C, T, H, W] replicated -> embedded tokens [B, T, S, D] sharded on ``shard_dim_after(-1)``."""
        batch, channels, frames, height, width = latents.shape
        tokens = latents.permute(0, 2, 3, 4, 1).reshape(batch, frames, height * width, channels)
        dim = shard_dim_after(-1)
        tokens = split(tokens, dim, group=ps.get_context_parallel_group())  # data: no gradient flows back
        n, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        sizes = chunk_sizes(self.video.frames if dim == FRAME_DIM else self.video.patches, n)
        start = sum(sizes[:rank])
        frame_pos, patch_pos = self.frame_pos, self.patch_pos
        # slice (not split) the positional tables so their gradient stays a partial sum
        if dim == FRAME_DIM:
            frame_pos = frame_pos[start:start + sizes[rank]]
        else:
            patch_pos = patch_pos[start:start + sizes[rank]]
        t = self.time_embed(_timestep_features(timestep, self.config.hidden_size))
        return self.patch_embed(tokens) + frame_pos[None, :, None] + patch_pos[None, None] + t[:, None, None]

    def _run_layer(self, layer: nn.Module, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Run one TransformerLayer along token dim ``dim``; every other dim folds into its batch."""
        batch, frames, patches, hidden = x.shape
        if dim == PATCH_DIM:  # [B, T_l, S, D] -> [S, B*T_l, D]
            h = x.permute(2, 0, 1, 3).reshape(patches, batch * frames, hidden)
        else:  # [B, T, S_l, D] -> [T, B*S_l, D]
            h = x.permute(1, 0, 2, 3).reshape(frames, batch * patches, hidden)
        if self.config.sequence_parallel:  # Megatron-SP inside TP: the layer sees 1/TP of ``dim``
            h = tensor_parallel.scatter_to_sequence_parallel_region(h)
        h, _ = layer(h, attention_mask=None)
        if self.config.sequence_parallel:
            # what follows is replicated over TP, so the gradient arriving here is already the full one
            # on every TP rank: its adjoint is a split, not a reduce-scatter
            h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        if dim == PATCH_DIM:  # [S, B*T_l, D] -> [B, T_l, S, D]
            return h.view(patches, batch, frames, hidden).permute(1, 2, 0, 3)
        return h.view(frames, batch, patches, hidden).permute(1, 0, 2, 3)  # [T, B*S_l, D] -> [B, T, S_l, D]

    def forward(self, latents: torch.Tensor | None, timestep: torch.Tensor | None) -> torch.Tensor:
        """First stage: latents [B, C, T, H, W] and timestep [B]; later stages use the received input.

        Returns the head output ``[B, T_l, S_l, C]`` (sharded on ``shard_dim_after(num_layers - 1)``)
        on the last stage, else the activation in Megatron's ``[tokens_local, B, D]`` layout.
        """
        group = ps.get_context_parallel_group()
        if self.pre_process:
            x = self.embed(latents, timestep)
        else:
            x = self._from_pipeline(self.input_tensor)
        with quantization_context(self.config):
            for i, layer in enumerate(self.layers):
                block = self.layer_offset + i
                cur, dim = shard_dim_after(block - 1), attend_dim(block)
                if cur == dim:  # S(attend) -> S(other): one all-to-all
                    full = self.video.frames if cur == FRAME_DIM else self.video.patches
                    x = dynamic_switch(x, cur, shard_dim_after(block), group=group, global_len=full)
                x = self._run_layer(layer, x, dim)
        if not self.post_process:
            return self._to_pipeline(x)
        return self.head(self.final_norm(x))
