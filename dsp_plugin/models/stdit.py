"""A spatial-temporal diffusion transformer of the OpenSora / Latte family, single-device code.

Video latents ``[B, C, T, H, W]`` are cut into (1, 2, 2) patches, giving tokens
``[B, T, S, D]`` (``S = H/2 * W/2``), or ``[B, T, H/2, W/2, D]`` with ``axes=3``.
Each layer is a run of ``AxialBlock``s, one per sequence dim: spatial then
temporal (or H, W, T). A block attends along its ``attend_dim`` only, for every
position of the other dims; that independence is what DSP exploits. Blocks are
pre-norm self-attention + optional cross-attention to text + MLP, conditioned
on the timestep through adaLN (shift, scale, gate), as in DiT; ``adaln_zero=True``
gives DiT's adaLN-Zero initialisation (off by default so that tests exercise every
gradient from the first step).

OpenSora 1.2 (STDiT3) features, each off by default (the model above is unchanged):

- ``temporal_rope``: rotary positions on q and k in temporal blocks, angle
  ``frame * base^(-2i/d)`` for the pair ``(i, i + d/2)`` of a head's dims; the
  temporal sin-cos table is then not added. ``spatial_rope``: 2-D rotary
  positions in spatial blocks (the first ``d/4`` pairs rotate by the patch row,
  the next ``d/4`` by its column; needs ``axes=2``), instead of the sin-cos table.
- ``qk_norm``: ``"LayerNorm"`` or ``"RMSNorm"`` over each head's q and k.
- ``text_mask`` ``[B, L]`` (True: a real caption token) in ``forward``: a key-padding
  mask for cross-attention, so each sample attends to its own caption length.
- ``adaln_single``: PixArt's adaLN-single. One ``t_block`` (SiLU, Linear(D, 6D))
  maps the timestep embedding to ``[B, 6, D]``; each block adds its own learned
  ``scale_shift_table [6, D]``, the final layer ``[2, D]`` to the embedding itself.

Nothing here knows about parallelism: every shape is read from the tensor the
module receives, so the same code runs on a shard. ``dsp_plugin.parallelize``
applies DSP from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AxialBlock", "STDiT", "STDiTConfig"]


@dataclass(frozen=True)
class STDiTConfig:
    depth: int = 2                       # layers; each has `axes` blocks
    hidden_size: int = 32
    num_heads: int = 2
    mlp_ratio: float = 4.0
    in_channels: int = 4
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int | None = 16            # cross-attention to a text embedding; None: off
    axes: int = 2                        # 2: spatial + temporal; 3: H, W and T separately
    adaln_zero: bool = False             # DiT's adaLN-Zero init: modulation and output layers start at zero
    temporal_rope: bool = False          # OpenSora 1.2: RoPE over frames in temporal blocks
    spatial_rope: bool = False           # 2-D RoPE over (row, column) in spatial blocks (axes=2)
    rope_base: float = 10000.0
    qk_norm: str | None = None           # "LayerNorm" | "RMSNorm" over each head's q and k
    adaln_single: bool = False           # PixArt / OpenSora adaLN-single

    @staticmethod
    def preset(name: str, **overrides: object) -> STDiTConfig:
        """``tiny`` (tests), ``720M`` and ``3B`` (the paper's Table 4; no cross-attention, as in A.1)."""
        presets = {
            "tiny": STDiTConfig(),
            "720M": STDiTConfig(depth=28, hidden_size=1152, num_heads=16, text_dim=None),
            "3B": STDiTConfig(depth=36, hidden_size=2048, num_heads=32, text_dim=None),
        }
        if name not in presets:
            raise ValueError(f"unknown STDiT preset {name!r}; expected one of {sorted(presets)}")
        return replace(presets[name], **overrides)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.axes not in (2, 3):
            raise ValueError(f"axes={self.axes}; expected 2 (spatial, temporal) or 3 (H, W, T)")
        if self.patch_size[0] != 1:
            raise ValueError(f"patch_size={self.patch_size}: temporal patch must be 1 (frames stay independent)")
        if self.qk_norm not in (None, "LayerNorm", "RMSNorm"):
            raise ValueError(f"qk_norm={self.qk_norm!r}; expected None, 'LayerNorm' or 'RMSNorm'")
        head_dim = self.hidden_size // self.num_heads
        if (self.temporal_rope or self.spatial_rope) and head_dim % (4 if self.spatial_rope else 2):
            raise ValueError(f"head dim {head_dim} must be divisible by {4 if self.spatial_rope else 2} for RoPE")
        if self.spatial_rope and self.axes != 2:
            raise ValueError(f"spatial_rope needs axes=2 (one spatial dim of H' x W' patches), got axes={self.axes}")


def sincos(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fixed sinusoidal position embedding ``[length, dim]``."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    emb = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)
    return emb.to(dtype)


def rope_angles(positions: torch.Tensor, pairs: int, base: float) -> torch.Tensor:
    """``[L]`` integer positions -> ``[L, pairs]`` rotation angles ``p * base^(-j / pairs)``."""
    inv = base ** (-torch.arange(pairs, dtype=torch.float32, device=positions.device) / pairs)
    return positions.float()[:, None] * inv[None]


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x_i, x_{i + d/2})`` of ``x [..., L, d]`` by ``angles [L, d/2]`` (complex product)."""
    half = x.shape[-1] // 2
    z = torch.view_as_complex(torch.stack([x[..., :half], x[..., half:]], dim=-1).float().contiguous())
    z = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles))
    return torch.cat([z[..., 0], z[..., 1]], dim=-1).to(x.dtype)


def _per_sample(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[B, D] -> [B, 1, .., 1, D]`` to broadcast over every sequence dim."""
    return v.view(v.shape[0], *([1] * (ndim - 2)), v.shape[1])


class Attention(nn.Module):
    """Multi-head attention ``[N, L, D] -> [N, L, D]``; keys/values from ``context`` if given."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None, qk_norm: str | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(context_dim or dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        if qk_norm:  # over each head's dims, as OpenSora's qk_norm and Megatron's --qk-layernorm
            norm = nn.LayerNorm if qk_norm == "LayerNorm" else nn.RMSNorm
            self.q_norm, self.k_norm = norm(dim // heads, eps=1e-6), norm(dim // heads, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``angles [L, d/2]``: RoPE on q and k; ``key_mask [N, L_k]`` (True: attend) masks keys."""
        n, length, dim = x.shape
        ctx = x if context is None else context
        head_dim = dim // self.heads  # explicit: a shard may hold no tokens at all
        q = self.q(x).view(n, length, self.heads, head_dim).transpose(1, 2)
        k, v = self.kv(ctx).view(n, ctx.shape[1], 2, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = rotate(q, angles), rotate(k, angles)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [N, heads, L, D/heads]
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))


class AxialBlock(nn.Module):
    """Pre-norm transformer block attending along one tensor dim of ``[B, *seq, D]``.

    ``attend_dim`` is a dim of the token tensor (1 = T, 2 = S, ...). The block
    is local along every other dim, which is what lets DSP shard those.
    """

    def __init__(self, config: STDiTConfig, attend_dim: int, *, add_pos_embed: bool) -> None:
        super().__init__()
        d = config.hidden_size
        self.attend_dim = attend_dim
        self.rope = config.temporal_rope if attend_dim == 1 else (config.spatial_rope and attend_dim == 2)
        self.rope_base, self.head_dim = config.rope_base, d // config.num_heads
        self.add_pos_embed = add_pos_embed and not self.rope  # RoPE replaces the table along its dim
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, config.num_heads, qk_norm=config.qk_norm)
        self.cross = Attention(d, config.num_heads) if config.text_dim else None
        self.norm_cross = nn.LayerNorm(d, eps=1e-6) if config.text_dim else None
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        hidden = int(d * config.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d))
        if config.adaln_single:  # PixArt: a learned table plus the model's shared t_block output
            self.scale_shift_table = nn.Parameter(torch.randn(6, d) / d**0.5)
        else:
            self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def _angles(self, length: int, width: int | None, device: torch.device) -> torch.Tensor:
        """RoPE angles ``[L, head_dim / 2]`` along the attended dim (never sharded: global positions)."""
        pos = torch.arange(length, device=device)
        if self.attend_dim == 1:  # frames
            return rope_angles(pos, self.head_dim // 2, self.rope_base)
        if width is None:
            raise ValueError("AxialBlock: 2-D spatial RoPE needs the patch grid width (hw=(H', W'))")
        quarter = self.head_dim // 4
        return torch.cat([rope_angles(pos // width, quarter, self.rope_base),
                          rope_angles(pos % width, quarter, self.rope_base)], dim=-1)

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor | None = None, *,
                text_mask: torch.Tensor | None = None, hw: tuple[int, int] | None = None) -> torch.Tensor:
        """``c``: the timestep embedding ``[B, D]`` (``[B, 6D]``, the t_block output, with adaLN-single);
        ``text_mask [B, L]`` (True: a caption token); ``hw``: the patch grid, for 2-D RoPE."""
        a, ndim = self.attend_dim, x.dim()
        if self.add_pos_embed:  # the attended dim is never sharded, so positions are global
            shape = [1] * ndim
            shape[a], shape[-1] = x.shape[a], x.shape[-1]
            x = x + sincos(x.shape[a], x.shape[-1], x.device, x.dtype).view(shape)
        if hasattr(self, "scale_shift_table"):
            mods = (self.scale_shift_table[None] + c.view(c.shape[0], 6, -1)).unbind(1)
        else:
            mods = self.adaln(c).chunk(6, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = (_per_sample(m, ndim) for m in mods)
        angles = self._angles(x.shape[a], hw[1] if hw else None, x.device) if self.rope else None
        h = self.norm1(x) * (1 + scale1) + shift1
        # [B, .., L_a, .., D] -> [B * rest, L_a, D] -> attention -> back
        h = h.movedim(a, -2)
        rest = h.shape[:-2]
        h = self.attn(h.reshape(-1, *h.shape[-2:]), angles=angles).view(*rest, *h.shape[-2:]).movedim(-2, a)
        x = x + gate1 * h
        if self.cross is not None and y is not None:
            # every token attends to its sample's text: [B, tokens, D] x [B, L_text, D]
            h = self.cross(self.norm_cross(x).reshape(x.shape[0], -1, x.shape[-1]), y, key_mask=text_mask)
            x = x + h.view_as(x)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class TimestepEmbedder(nn.Module):
    def __init__(self, d: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, d), nn.SiLU(), nn.Linear(d, d))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class PatchEmbed(nn.Module):
    """``[B, C, T, H, W] -> [B, T, S, D]`` (axes=2) or ``[B, T, H', W', D]`` (axes=3); per frame."""

    def __init__(self, config: STDiTConfig) -> None:
        super().__init__()
        self.axes = config.axes
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, config.patch_size, config.patch_size)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.proj(latents).permute(0, 2, 3, 4, 1)      # [B, T, H', W', D]
        return x.flatten(2, 3) if self.axes == 2 else x


class FinalLayer(nn.Module):
    def __init__(self, config: STDiTConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        if config.adaln_single:  # PixArt's T2IFinalLayer: a table plus the timestep embedding itself
            self.scale_shift_table = nn.Parameter(torch.randn(2, d) / d**0.5)
        else:
            self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.linear = nn.Linear(d, math.prod(config.patch_size) * config.in_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "scale_shift_table"):
            mods = (self.scale_shift_table[None] + c[:, None]).unbind(1)
        else:
            mods = self.adaln(c).chunk(2, dim=-1)
        shift, scale = (_per_sample(m, x.dim()) for m in mods)
        return self.linear(self.norm(x) * (1 + scale) + shift)


class Unpatchify(nn.Module):
    """Tokens ``[B, T, S | H', W', pt*ph*pw*C]`` -> latents ``[B, C, T, H, W]``; needs every spatial token."""

    def __init__(self, config: STDiTConfig) -> None:
        super().__init__()
        self.patch, self.channels = config.patch_size, config.in_channels

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        pt, ph, pw = self.patch
        b, t = x.shape[:2]
        x = x.reshape(b, t, height // ph, width // pw, pt, ph, pw, self.channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)                 # [B, C, T, pt, H', ph, W', pw]
        return x.reshape(b, self.channels, t * pt, height, width)


class STDiT(nn.Module):
    """``forward(latents [B,C,T,H,W], timestep [B], text [B,L,text_dim] | None) -> [B,C,T,H,W]``."""

    def __init__(self, config: STDiTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedder = PatchEmbed(config)
        self.t_embedder = TimestepEmbedder(config.hidden_size)
        self.text_proj = nn.Linear(config.text_dim, config.hidden_size) if config.text_dim else None
        if config.adaln_single:  # one modulation for all blocks (PixArt, OpenSora 1.2)
            self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(config.hidden_size, 6 * config.hidden_size))
        # token dims: 1 = T, then S (axes=2) or H', W' (axes=3). Spatial first, temporal last.
        order = [2, 1] if config.axes == 2 else [2, 3, 1]
        self.blocks = nn.ModuleList(
            AxialBlock(config, dim, add_pos_embed=(layer == 0))
            for layer in range(config.depth) for dim in order)
        self.final_layer = FinalLayer(config)
        self.unpatchify = Unpatchify(config)
        if config.adaln_zero:  # every block starts as the identity and the model outputs zeros (DiT)
            modulations = [self.t_block[1]] if config.adaln_single else \
                [b.adaln[1] for b in self.blocks] + [self.final_layer.adaln[1]]
            for linear in modulations + [self.final_layer.linear]:
                nn.init.zeros_(linear.weight)
                nn.init.zeros_(linear.bias)

    @property
    def sequence_dims(self) -> tuple[int, ...]:
        """The token-tensor dims that are sequences (candidates for sharding)."""
        return tuple(range(1, self.config.axes + 1))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor | None = None,
                text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``text_mask [B, L]`` bool (True: a caption token): cross-attention ignores the padding."""
        cfg = self.config
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise ValueError(f"STDiT: latents must be [B, {cfg.in_channels}, T, H, W], got {tuple(latents.shape)}")
        height, width = latents.shape[-2:]
        if height % cfg.patch_size[1] or width % cfg.patch_size[2]:
            raise ValueError(f"STDiT: H={height}, W={width} must be divisible by the patch {cfg.patch_size[1:]}")
        x = self.embedder(latents)
        c = self.t_embedder(timestep)
        y = self.text_proj(text) if self.text_proj is not None and text is not None else None
        if text_mask is not None and (y is None or text_mask.shape != y.shape[:2]):
            raise ValueError(f"STDiT: text_mask {tuple(text_mask.shape)} must be [B, L] of the text "
                             f"{None if y is None else tuple(y.shape)}")
        modulation = self.t_block(c) if cfg.adaln_single else c
        extra = {}
        if text_mask is not None:
            extra["text_mask"] = text_mask.bool()
        if cfg.spatial_rope:
            extra["hw"] = (height // cfg.patch_size[1], width // cfg.patch_size[2])
        for block in self.blocks:
            x = block(x, modulation, y, **extra)
        return self.unpatchify(self.final_layer(x, c), height, width)
