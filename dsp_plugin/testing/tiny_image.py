"""Tiny random-weight diffusers image transformers with a batch each, by name (nothing is downloaded).

Like ``tiny_video.CASES`` (fp32, weights from ``torch.manual_seed(0)``, zero-initialised parameters filled, 2
samples): ``heads`` (3 by default), ``size`` (the latent height = width in patches: ``size * size`` image tokens) and
``text`` tokens set the shape. Registered in ``tiny_video.CASES`` as ``tiny-flux``.
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.testing.tiny_video import BATCH, HEADS, TEXT, TEXT_DIM, fill_zeros

__all__ = ["flux"]


def flux(heads: int = HEADS, size: int = 4, text: int = TEXT) -> tuple[Any, dict[str, Any]]:
    """``FluxTransformer2DModel``: 1 double-stream and 1 single-stream block (joint attention of text and image
    tokens), packed latents ``[B, size*size, C]``, position ids per image and text token."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=heads, joint_attention_dim=TEXT_DIM,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    img_ids = torch.stack([torch.zeros(size * size), rows.flatten().float(), cols.flatten().float()], dim=1)
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, size * size, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(BATCH, 8, generator=g), "timestep": torch.tensor([0.3, 0.7]),
        "img_ids": img_ids, "txt_ids": torch.zeros(text, 3)}
