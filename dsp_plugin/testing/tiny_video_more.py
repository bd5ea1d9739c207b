"""Tiny random-weight diffusers video transformers that have no built-in plan yet: Wan VACE, Cosmos, Kandinsky 5.

Each function returns ``(model, kwargs)`` like ``tiny_video.CASES`` (fp32, weights
from ``torch.manual_seed(0)``, zero-initialised parameters filled, 3 heads, 2
samples, 5 latent frames of 3x3 patches unless said otherwise). What makes each
worth checking: Wan VACE's control blocks return a tuple (the hint for the main
stream, the control stream for the next control block); Cosmos and Kandinsky 5
keep modules in fp32 (``_keep_in_fp32_modules``) and fail when the whole model is
cast to fp64, so the plan checker checks them in their own dtypes
(``python -m dsp_plugin.check --dtype model``).
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.testing.tiny_video import BATCH, FRAMES, HEADS, SIZE, TEXT, TEXT_DIM, fill_zeros

__all__ = ["cosmos", "kandinsky5", "wan_vace"]


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def wan_vace() -> tuple[Any, dict[str, Any]]:
    """``WanVACETransformer3DModel``: 2 main blocks, a control block before each (``vace_layers=[0, 1]``), whose
    hints are added after the main block of the same index."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, vace_layers=[0, 1],
        vace_in_channels=6)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, 4, FRAMES, SIZE, SIZE, generator=g), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "control_hidden_states": torch.randn(BATCH, 6, FRAMES, SIZE, SIZE, generator=g)}


def cosmos() -> tuple[Any, dict[str, Any]]:
    """``CosmosTransformer3DModel`` (Cosmos 1.0 layout) with its learnable positions, the module it keeps in fp32
    (``torch.linalg.vector_norm(..., dtype=torch.float32)``: refuses a float64 input); no padding-mask channel
    (that path needs torchvision)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(0)
    model = CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=2, mlp_ratio=2.0,
        text_embed_dim=TEXT_DIM, adaln_lora_dim=8, max_size=(8, 8, 8), patch_size=(1, 2, 2),
        concat_padding_mask=False, extra_pos_embed_type="learnable")
    g = _g()
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, 4, FRAMES, SIZE, SIZE, generator=g), "timestep": torch.tensor([3.0, 700.0]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g)}


def kandinsky5() -> tuple[Any, dict[str, Any]]:
    """``Kandinsky5Transformer3DModel`` (2 text, 2 visual blocks), which keeps its time embedding and modulations in
    fp32 (a float64 model fails: ``mat1 and mat2 must have the same dtype``). Its latents are channels-last
    ``[B, F, H, W, C]``."""
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(0)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=HEADS * 12, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 4, 4))
    g = _g()
    frames, h, w = FRAMES, SIZE // 2, SIZE // 2
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, frames, SIZE, SIZE, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g), "timestep": torch.tensor([3.0, 700.0]),
        "pooled_projections": torch.randn(BATCH, 8, generator=g),
        "visual_rope_pos": [torch.arange(frames), torch.arange(h), torch.arange(w)],
        "text_rope_pos": torch.arange(TEXT)}
