"""Tiny random-weight diffusers video transformers with joint or fused streams, by name (nothing is downloaded).

Each function returns ``(model, kwargs)`` like ``tiny_video.CASES`` (fp32, weights
from ``torch.manual_seed(0)``, zero-initialised parameters filled, 3 heads, 2
samples, 5 latent frames of 3x3 patches, 45 video tokens: uneven on 2 and 4 ranks,
7 text tokens of which sample 0 pads some) unless its docstring says otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.testing.tiny_video import BATCH, FRAMES, HEADS, SIZE, TEXT, TEXT_DIM, fill_zeros

__all__ = ["hunyuan_video15", "kandinsky6", "motif_video", "sana_video"]


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _mask(valid: int) -> torch.Tensor:
    mask = torch.ones(BATCH, TEXT)
    mask[0, valid:] = 0  # sample 0's text is padded after `valid` tokens, sample 1's is whole
    return mask


def _latents(g: torch.Generator, channels: int = 4, frames: int = FRAMES) -> torch.Tensor:
    return torch.randn(BATCH, channels, frames, SIZE, SIZE, generator=g)


def hunyuan_video15() -> tuple[Any, dict[str, Any]]:
    """``HunyuanVideo15Transformer3DModel`` (image to video): an image embedding, the second text stream (ByT5) and
    the first, each padded differently per sample, joined after the video tokens; its attention processor builds
    the mask ``[B, 1, S, S]`` from the tokens it is called with (patch 2: 45 tokens)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
        text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 4, 4), target_size=16, task_type="i2v")
    g = _g()
    mask_2 = torch.ones(BATCH, 4)
    mask_2[1, 3:] = 0
    return fill_zeros(model), {
        "hidden_states": _latents(g), "timestep": torch.tensor([3.0, 700.0]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g), "encoder_attention_mask": _mask(4),
        "encoder_hidden_states_2": torch.randn(BATCH, 4, 8, generator=g), "encoder_attention_mask_2": mask_2,
        "image_embeds": torch.randn(BATCH, 3, 12, generator=g)}


def motif_video() -> tuple[Any, dict[str, Any]]:
    """``MotifVideoTransformer3DModel``: 1 dual-stream and 1 single-stream block with the text after the video
    tokens (an image embedding before it) and text cross-attention, then 1 decoder block attending the embedded input
    jointly with their output. It runs in fp32 at most: its time embedding feeds its fp32 sinusoid to a linear layer
    of the model's dtype unless that is fp16 or bf16."""
    from diffusers import MotifVideoTransformer3DModel

    torch.manual_seed(0)
    model = MotifVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=1,
        num_single_layers=2, num_decoder_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
        image_embed_dim=8,
        rope_axes_dim=(4, 4, 4), enable_text_cross_attention_dual=True, enable_text_cross_attention_single=True)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "timestep": torch.tensor([3.0, 700.0]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g), "encoder_attention_mask": _mask(4),
        "image_embeds": torch.randn(BATCH, 2, 8, generator=g)}


def kandinsky6() -> tuple[Any, dict[str, Any]]:
    """``Kandinsky6Transformer3DModel``: video (``[B, F, H, W, C]``, with its conditioning latent and mask) and 6
    audio tokens in 2 fused blocks, each stream attending itself, its text and the other stream (RoPE in the cross-
    modal attention too); padded text."""
    from diffusers import Kandinsky6Transformer3DModel

    torch.manual_seed(0)
    model = Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
        model_dim=HEADS * 12, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 4, 4), visual_cond=True,
        in_audio_dim=4, out_audio_dim=4, model_dim_a=24, ff_dim_a=16, axes_dims_a=(4, 4, 4), ca_rope=True)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, FRAMES, SIZE, SIZE, 9, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(BATCH, 8, generator=g), "timestep": torch.tensor([3.0, 700.0]),
        "audio_hidden_states": torch.randn(BATCH, 6, 4, generator=g),
        "encoder_attention_mask": _mask(4).bool()}


def sana_video() -> tuple[Any, dict[str, Any]]:
    """``SanaVideoTransformer3DModel``: linear attention over the video tokens (per head, fp32 inside), a
    feed-forward whose convolutions mix 3x3 patches within a frame and 3 frames in time, padded text."""
    from diffusers import SanaVideoTransformer3DModel

    torch.manual_seed(0)
    model = SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=HEADS, cross_attention_head_dim=8, cross_attention_dim=HEADS * 8,
        caption_channels=TEXT_DIM, mlp_ratio=2.0, sample_size=SIZE, patch_size=(1, 2, 2), rope_max_seq_len=32)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "timestep": torch.tensor([3.0, 700.0]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g), "encoder_attention_mask": _mask(4)}
