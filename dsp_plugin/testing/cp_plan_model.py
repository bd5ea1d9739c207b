"""A small video DiT that declares diffusers' context-parallel plan (``_cp_plan``) and has no built-in DSP plan.

``parallelize(model)`` derives its plan from ``_cp_plan`` (``plan/builtin/from_cp_plan.py``). Built from diffusers'
Wan components, as a model of one's own would be: 3D RoPE, blocks of self-attention (``attn1``), text cross-
attention (``attn2``) and a feed-forward, a per-sample modulation; tokens split at the first block, RoPE split at
its output, the output gathered after ``proj_out`` (diffusers' own plan for Wan, without its per-token timestep).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

__all__ = ["CPPlanDiT", "cp_plan_case"]


class CPPlanDiT(nn.Module):
    """Latents ``[B, C, F, H, W]`` (patch 1x2x2) -> the same shape, with text ``[B, S, text_dim]`` and a timestep per
    sample."""

    _cp_plan = {
        "rope": {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
                 1: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)},
        "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                     "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }

    def __init__(self, channels: int = 4, heads: int = 3, head_dim: int = 8, text_dim: int = 16,
                 layers: int = 2) -> None:
        super().__init__()
        from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

        dim = heads * head_dim
        self.rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), 32)
        self.patch = nn.Conv3d(channels, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text = nn.Linear(text_dim, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList([WanTransformerBlock(dim, 2 * dim, heads, cross_attn_norm=True)
                                     for _ in range(layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, channels * 4)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = hidden_states.shape
        rotary = self.rope(hidden_states)
        x = self.patch(hidden_states).flatten(2).transpose(1, 2)  # [B, F*H/2*W/2, D]
        temb = self.time(timestep[:, None].to(x.dtype) / 1000).unflatten(1, (6, -1))  # [B, 6, D]
        text = self.text(encoder_hidden_states)
        for block in self.blocks:
            x = block(x, text, temb, rotary)
        out = self.proj_out(self.norm_out(x))  # [B, L, C*2*2]
        return out.view(b, f, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)


def cp_plan_case() -> tuple[CPPlanDiT, dict[str, Any]]:
    """``CPPlanDiT`` (3 heads, 2 layers, random weights from ``torch.manual_seed(0)``) and a batch: 2 samples of 5
    frames of 3x3 patches (45 tokens, uneven on 2 and 4 ranks), 7 text tokens."""
    torch.manual_seed(0)
    model = CPPlanDiT()
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(2, 4, 5, 6, 6, generator=g), "timestep": torch.tensor([3.0, 700.0]),
                   "encoder_hidden_states": torch.randn(2, 7, 16, generator=g)}
