"""Tiny random-weight diffusers video transformers of Wan's family and the packed ones, by name (nothing is downloaded).

Each function returns ``(model, kwargs)`` like ``tiny_video.CASES`` (fp32, weights
from ``torch.manual_seed(0)``, zero-initialised parameters filled, 3 heads, 2
samples, 5 latent frames of 3x3 patches, 45 video tokens: uneven on 2 and 4 ranks,
7 text tokens) unless its docstring says otherwise; ``heads``, ``size`` (latent height = width), ``text`` and
``frames`` change that shape where a builder takes them (``bench.cp_plan_models``: shapes diffusers' Ulysses
runs). Their models keep modules in fp32 (``_keep_in_fp32_modules``); ``tiny_video.case`` casts them as
``from_pretrained(torch_dtype=...)`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.testing.tiny_video import BATCH, FRAMES, HEADS, SIZE, TEXT, TEXT_DIM, fill_zeros

__all__ = ["anyflow", "chronoedit", "helios", "ltx2", "minimax_h3", "wan_animate"]


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _latents(g: torch.Generator, channels: int = 4, frames: int = FRAMES, size: int = SIZE) -> torch.Tensor:
    return torch.randn(BATCH, channels, frames, size, size, generator=g)


def chronoedit(heads: int = HEADS, size: int = SIZE, frames: int = FRAMES) -> tuple[Any, dict[str, Any]]:
    """``ChronoEditTransformer3DModel``: Wan's blocks with its own RoPE; an image embedding joined to the text."""
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(0)
    model = ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, image_dim=8,
        added_kv_proj_dim=heads * 8)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g, frames=frames, size=size), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(BATCH, 3, 8, generator=g)}


def wan_animate() -> tuple[Any, dict[str, Any]]:
    """``WanAnimateTransformer3DModel``: a pose video added to every frame but the first, a face video whose motion
    vectors (one per latent frame) the face adapter after blocks 0 and 2 attends frame by frame (4 layers)."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(0)
    model = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=12, latent_channels=4,
        out_channels=4, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=4, image_dim=8, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8}, motion_encoder_size=16, motion_style_dim=8,
        motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
        inject_face_latents_blocks=2)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g, 12), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(BATCH, 3, 8, generator=g),
        "pose_hidden_states": _latents(g, 4, FRAMES - 1),
        "face_pixel_values": torch.randn(BATCH, 3, 13, 16, 16, generator=g)}


def anyflow() -> tuple[Any, dict[str, Any]]:
    """``AnyFlowTransformer3DModel``: Wan's backbone conditioned on a source and a target timestep per frame (the
    modulation per token); latents ``[B, F, C, H, W]``; its RoPE a dict of complex tables."""
    from diffusers import AnyFlowTransformer3DModel

    torch.manual_seed(0)
    model = AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    g = _g()
    t = torch.randint(1, 1000, (BATCH, FRAMES), generator=g).float()
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, FRAMES, 4, SIZE, SIZE, generator=g), "timestep": t, "r_timestep": t / 2,
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g)}


def helios(heads: int = HEADS, size: int = SIZE) -> tuple[Any, dict[str, Any]]:
    """``HeliosTransformer3DModel``: 3 new frames (27 tokens) after 1 frame of short history (9 tokens) and 2 of mid
    history (2x down, 2 tokens); history keys amplified, cross-attention on the new tokens only (38 tokens)."""
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(0)
    model = HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_dim=(4, 4, 4), is_amplify_history=True)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g, 4, 3, size), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "indices_hidden_states": torch.tensor([[3, 4, 5]] * BATCH),
        "indices_latents_history_short": torch.tensor([[2]] * BATCH),
        "latents_history_short": _latents(g, 4, 1, size),
        "indices_latents_history_mid": torch.tensor([[0, 1]] * BATCH),
        "latents_history_mid": _latents(g, 4, 2, size)}


def minimax_h3(heads: int = HEADS, size: int = SIZE, text: int = TEXT,
               frames: int = FRAMES) -> tuple[Any, dict[str, Any]]:
    """``MiniMaxH3Transformer3DModel``: one packed sequence of 7 text, 45 video and 6 audio rows, interleaved, the
    video rows at two noise levels (a conditioning frame), an AdaLN row per (timestep, modality)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=12, hidden_size=heads * 12, num_layers=2, num_refiner_layers=1,
        ffn_dim=32, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=TEXT_DIM, freq_dim=16,
        time_embed_hidden_dim=16, time_embed_dim=16, rope_freq_dim=2)
    g = _g()
    video, audio = frames * (size // 2) ** 2, 6
    seq = text + video + audio
    order = torch.randperm(seq, generator=g)
    text_indices, video_indices, audio_indices = order[:text], order[text:text + video], order[text + video:]
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text_indices], tags[audio_indices] = 1, 2
    timestep_indices = torch.zeros(seq, dtype=torch.long)
    timestep_indices[video_indices[:(size // 2) ** 2]] = 1  # the first frame's rows: a clean conditioning frame
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, video, 16, generator=g),
        "audio_hidden_states": torch.randn(BATCH, audio, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, TEXT_DIM, generator=g),
        "timestep": torch.tensor([0.7, 0.0]), "timestep_indices": timestep_indices, "token_tags": tags,
        "position_ids": torch.randint(0, 8, (seq, 3), generator=g), "video_indices": video_indices,
        "audio_indices": audio_indices, "text_indices": text_indices}


def ltx2(heads: int = HEADS, size: int = SIZE, text: int = TEXT, frames: int = FRAMES) -> tuple[Any, dict[str, Any]]:
    """``LTX2VideoTransformer3DModel``: 45 video tokens (patchified ``[B, L, C]``, a timestep per token) and 6 audio
    tokens, padded text for each stream, audio-to-video and video-to-audio cross-attention in every block."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=8, cross_attention_dim=heads * 8,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=TEXT_DIM, rope_double_precision=True)
    g = _g()
    side = size // 2
    tokens = frames * side * side
    timestep = torch.tensor([3.0, 700.0])[:, None].repeat(1, tokens)
    timestep[:, :side * side] = 0.0  # the first frame is a clean condition
    mask = torch.ones(BATCH, text)
    mask[0, 4:] = 0
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, tokens, 4, generator=g),
        "audio_hidden_states": torch.randn(BATCH, 6, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, TEXT_DIM, generator=g),
        "audio_encoder_hidden_states": torch.randn(BATCH, text, TEXT_DIM, generator=g),
        "timestep": timestep, "audio_timestep": torch.tensor([3.0, 700.0]),
        "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
        "num_frames": frames, "height": side, "width": side, "audio_num_frames": 6, "fps": 24.0}
