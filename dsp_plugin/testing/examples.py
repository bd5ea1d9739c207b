"""Two small single-device video models that know nothing of DSP, for docs/models.md's plans.

``DividedSpaceTime``: factorized, written like diffusers' Latte — spatial blocks
on ``[B*T, S, D]``, temporal blocks on ``[B*S, T, D]``, the forward reshaping
between them inline with its own ``B`` and a per-frame conditioning repeated to
rows. ``VideoViT``: a classifier with full attention over ``1 + T*S`` tokens whose
first token is a learned CLS token (it belongs to no position) and whose head
reads that token. ``JointDiT``: a two-stream video DiT whose blocks attend over
text and video tokens concatenated (CogVideoX's joint attention), the text
stream carried through every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "DividedSpaceTime", "JointDiT", "VideoViT"]


class Attention(nn.Module):
    """Self-attention through ``scaled_dot_product_attention`` on ``[B, L, D]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-norm attention + MLP; ``cond`` (one row per row of ``x``) shifts the normalised input."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x) if cond is None else self.norm1(x) + cond[:, None]
        x = x + self.attn(h)
        return x + self.mlp(self.norm2(x))


class DividedSpaceTime(nn.Module):
    """``video [B, T, S, C]`` and ``frame_cond [B, T, D]`` -> ``[B, T, S, C]``."""

    def __init__(self, channels: int = 4, dim: int = 16, heads: int = 2, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(channels, dim)
        self.spatial = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.temporal = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, channels)

    def forward(self, video: torch.Tensor, frame_cond: torch.Tensor) -> torch.Tensor:
        b, t, s, c = video.shape
        x = self.embed(video.reshape(b * t, s, c))                     # [B*T, S, D]
        cond = frame_cond.reshape(b * t, -1)                           # one row per (b, t)
        for spatial, temporal in zip(self.spatial, self.temporal):
            x = spatial(x, cond)
            x = x.reshape(b, -1, *x.shape[1:]).transpose(1, 2).flatten(0, 1)  # [B*S, T, D]
            x = temporal(x)
            x = x.reshape(b, -1, *x.shape[1:]).transpose(1, 2).flatten(0, 1)  # [B*T, S, D]
        return self.out(self.norm(x)).reshape(b, t, s, c)


class VideoViT(nn.Module):
    """``video [B, T, S, C]`` -> class logits ``[B, classes]``, full attention over CLS + T*S tokens."""

    def __init__(self, channels: int = 4, dim: int = 18, heads: int = 3, layers: int = 2, classes: int = 5,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(channels, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        x = self.embed(video.flatten(1, 2))                            # [B, T*S, D]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)  # [B, 1 + T*S, D]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class JointAttention(nn.Module):
    """CogVideoX-style joint attention: text and video tokens concatenated, one q/k/v projection, split after.

    ``text_first``: the text goes before the video tokens (CogVideoX) or after them (SD3, HunyuanVideo).
    """

    def __init__(self, dim: int, heads: int, text_first: bool = True) -> None:
        super().__init__()
        self.attn, self.text_first = Attention(dim, heads), text_first

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r, length = text.shape[1], x.shape[1]
        out = self.attn(torch.cat([text, x] if self.text_first else [x, text], dim=1))  # [B, R + L, D]
        return (out[:, r:], out[:, :r]) if self.text_first else (out[:, :length], out[:, length:])


class JointBlock(nn.Module):
    """A two-stream block: per-stream norms and MLPs, one joint attention; ``cond [B, D]`` shifts both streams."""

    def __init__(self, dim: int, heads: int, text_first: bool = True) -> None:
        super().__init__()
        self.norm1, self.norm1_text = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = JointAttention(dim, heads, text_first)
        self.norm2, self.norm2_text = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mlp, self.mlp_text = (nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                   for _ in range(2))

    def forward(self, x: torch.Tensor, text: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, t = self.attn(self.norm1(x) + cond[:, None], self.norm1_text(text) + cond[:, None])
        x, text = x + a, text + t
        return x + self.mlp(self.norm2(x)), text + self.mlp_text(self.norm2_text(text))


class JointDiT(nn.Module):
    """``video [B, T, S, C]``, ``text [B, R, E]``, ``timestep [B]`` -> ``[B, T, S, C]``; joint attention, R + T*S."""

    def __init__(self, channels: int = 4, text_dim: int = 6, dim: int = 18, heads: int = 3, layers: int = 2,
                 text_first: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.text_embed = nn.Linear(channels, dim), nn.Linear(text_dim, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(JointBlock(dim, heads, text_first) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, channels)

    def forward(self, video: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        b, t, s, c = video.shape
        x = self.embed(video.flatten(1, 2))                            # [B, T*S, D]
        context, cond = self.text_embed(text), self.time(timestep[:, None].to(x.dtype))
        for block in self.blocks:
            x, context = block(x, context, cond)                       # the text stream goes through every block
        return self.out(self.norm(x)).reshape(b, t, s, c)
