"""Tiny random-weight diffusers video transformers with a batch each, by name (nothing is downloaded).

``CASES[name]()`` returns ``(model, kwargs)``: the model (fp32, weights from
``torch.manual_seed(0)``, zero-initialised parameters filled so that every path
carries signal) and the keyword arguments of one forward as the model's own
pipeline passes them. Every case has 3 attention heads (on 4 ranks one rank holds
none), 2 samples and 5 latent frames of 3x3 patches (45 video tokens: uneven on 2
and 4 ranks) unless its name says otherwise, and 7 text tokens of which sample 0
pads some where the model takes a text mask. Shared by ``tests/test_plan_models.py``
and the plan checker (``python -m dsp_plugin.check --model tiny-mochi``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CASES", "case", "cast", "fill_zeros", "hunyuan_video_pipeline", "keep_fp32"]

BATCH, FRAMES, SIZE, TEXT, TEXT_DIM, HEADS = 2, 5, 6, 7, 16, 3


def fill_zeros(model: torch.nn.Module) -> torch.nn.Module:
    """Zero-initialised gates and tables would hide a path: give them small random values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _text_mask(valid: int = 4, text: int = TEXT) -> torch.Tensor:
    mask = torch.ones(BATCH, text)
    mask[0, valid:] = 0  # sample 0's text is padded after `valid` tokens, sample 1's is whole
    return mask


def _latents(g: torch.Generator, frames: int = FRAMES, channels: int = 4, size: int = SIZE) -> torch.Tensor:
    return torch.randn(BATCH, channels, frames, size, size, generator=g)


def hunyuan_video() -> tuple[Any, dict[str, Any]]:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=False, text_embed_dim=TEXT_DIM, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4))
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "encoder_attention_mask": _text_mask(4), "pooled_projections": torch.randn(BATCH, 8, generator=g)}


def hunyuan_video_pipeline() -> Any:
    """A ``HunyuanVideoPipeline``: ``hunyuan_video``'s model, a tiny ``AutoencoderKLHunyuanVideo`` (x4 in time, x2
    in space, causal in time), FlowMatch Euler (shift 7), no text encoders: pass ``prompt_embeds``,
    ``pooled_prompt_embeds`` and ``prompt_attention_mask`` (``hunyuan_video()``'s inputs hold a batch of them).
    The progress bar is off. Nothing is downloaded."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    model, _ = hunyuan_video()
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                    down_block_types=("HunyuanVideoDownBlock3D",) * 2,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 2, block_out_channels=(8, 16),
                                    layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=2,
                                    temporal_compression_ratio=4, mid_block_add_attention=False)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=model, vae=vae.eval(),
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
                                tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ltx_video(per_token: bool = False, *, heads: int = HEADS, size: int = SIZE, text: int = TEXT,
              frames: int = FRAMES) -> tuple[Any, dict[str, Any]]:
    """LTX-Video takes patchified latents ``[B, F*H*W, C]`` (patch 1); ``per_token``: a timestep per token, as
    ``LTXConditionPipeline`` passes for its conditioning frames. ``heads``, ``size`` (``size // 2`` patches a side),
    ``text`` tokens and latent ``frames`` change the shape (``bench.cp_plan_models``: shapes diffusers' Ulysses
    runs)."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=12,
                                       cross_attention_dim=heads * 12, num_layers=2, caption_channels=TEXT_DIM)
    g = _g()
    side = size // 2
    tokens = frames * side * side
    timestep = torch.tensor([3.0, 700.0])
    if per_token:
        timestep = timestep[:, None].repeat(1, tokens)
        timestep[:, :9] = 0.0  # the first frame is a clean condition
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, tokens, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, TEXT_DIM, generator=g), "timestep": timestep,
        "encoder_attention_mask": _text_mask(4, text), "num_frames": frames, "height": side, "width": side,
        "rope_interpolation_scale": (8 / 25, 32, 32)}


def mochi() -> tuple[Any, dict[str, Any]]:
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(patch_size=2, num_attention_heads=HEADS, attention_head_dim=12, num_layers=2,
                                    pooled_projection_dim=16, in_channels=4, text_embed_dim=TEXT_DIM,
                                    time_embed_dim=16, max_sequence_length=TEXT)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "timestep": torch.tensor([3, 700]), "encoder_attention_mask": _text_mask(3)}


def skyreels_v2(mode: str = "t2v") -> tuple[Any, dict[str, Any]]:
    """``mode``: ``"t2v"`` (a timestep per sample), ``"df"`` (diffusion forcing: a timestep per frame) or
    ``"causal"`` (diffusion forcing with causal blocks of 2 frames: 6 frames, a block-causal mask)."""
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(0)
    model = SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        num_frame_per_block=2 if mode == "causal" else 1)
    g = _g()
    frames = 6 if mode == "causal" else FRAMES
    kwargs: dict[str, Any] = {"hidden_states": _latents(g, frames), "timestep": torch.tensor([3, 700]),
                              "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g)}
    if mode != "t2v":
        kwargs["timestep"] = torch.randint(0, 1000, (BATCH, frames), generator=g)
        kwargs["enable_diffusion_forcing"] = True
    return fill_zeros(model), kwargs


def easyanimate() -> tuple[Any, dict[str, Any]]:
    """EasyAnimate v5.1's layout: the first block MMDiT (separate text projections), the second shared; a second
    text stream (T5) concatenated to the first."""
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(0)
    model = EasyAnimateTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2, num_layers=2,
        mmdit_layers=1, time_embed_dim=16, text_embed_dim=TEXT_DIM, text_embed_dim_t5=12)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "encoder_hidden_states_t5": torch.randn(BATCH, 3, 12, generator=g)}


def allegro() -> tuple[Any, dict[str, Any]]:
    """Allegro's RoPE as ``AllegroPipeline`` passes it: ``((cos, sin) per axis, positions per axis)``."""
    from diffusers import AllegroTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    torch.manual_seed(0)
    model = AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=HEADS, attention_head_dim=12, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=36, sample_height=SIZE, sample_width=SIZE, sample_frames=FRAMES,
        caption_channels=TEXT_DIM)
    *freqs, t, h, w = get_3d_rotary_pos_embed_allegro(embed_dim=12, crops_coords=((0, 0), (3, 3)), grid_size=(3, 3),
                                                      temporal_size=FRAMES)
    positions = torch.cartesian_prod(t.long(), h.long(), w.long()).reshape(-1, 3).transpose(0, 1)
    rope = (tuple(freqs), tuple(positions.reshape(3, 1, -1).contiguous()))
    g = _g()
    return fill_zeros(model), {
        "hidden_states": _latents(g), "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "timestep": torch.tensor([3, 700]), "encoder_attention_mask": _text_mask(4), "image_rotary_emb": rope}


def consisid() -> tuple[Any, dict[str, Any]]:
    """ConsisID with its identity path (``is_train_face``: a face embedding and ViT features, a perceiver
    cross-attention after every block) and 3D RoPE passed in as ``ConsisIDPipeline`` computes it."""
    from diffusers import ConsisIDTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    torch.manual_seed(0)
    model = ConsisIDTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=TEXT_DIM, num_layers=2, sample_width=SIZE, sample_height=SIZE, sample_frames=FRAMES,
        patch_size=2, max_text_seq_length=TEXT, use_rotary_positional_embeddings=True, is_train_face=True,
        cross_attn_interval=1, cross_attn_dim_head=8, cross_attn_num_heads=2, LFE_id_dim=8, LFE_vit_dim=8,
        LFE_depth=2, LFE_dim_head=4, LFE_num_heads=2, LFE_num_id_token=2, LFE_num_querie=4, LFE_output_dim=32,
        LFE_ff_mult=1, LFE_num_scale=2)
    rope = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (3, 3)), grid_size=(3, 3), temporal_size=FRAMES)
    g = _g()
    return fill_zeros(model), {
        "hidden_states": torch.randn(BATCH, FRAMES, 4, SIZE, SIZE, generator=g),  # [B, F, C, H, W]
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g), "timestep": torch.tensor([3, 700]),
        "image_rotary_emb": rope, "id_cond": torch.randn(BATCH, 8, generator=g),
        "id_vit_hidden": [torch.randn(BATCH, 5, 8, generator=g) for _ in range(2)]}


def framepack() -> tuple[Any, dict[str, Any]]:
    """Framepack with its history: 4x, 2x and clean history latents packed before 3 new frames (41 tokens),
    an image embedding, padded text (batch > 1: the model builds a key-padding mask)."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=False, text_embed_dim=TEXT_DIM, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4),
        has_image_proj=True, image_proj_dim=8, has_clean_x_embedder=True)
    g = _g()

    def indices(*frames: int) -> torch.Tensor:  # the frames' positions in the whole video, shared by the batch
        return torch.tensor(frames)

    return fill_zeros(model), {
        "hidden_states": _latents(g, 3), "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g),
        "encoder_attention_mask": _text_mask(4), "pooled_projections": torch.randn(BATCH, 8, generator=g),
        "image_embeds": torch.randn(BATCH, 2, 8, generator=g), "indices_latents": indices(7, 8, 9),
        "latents_clean": _latents(g, 1), "indices_latents_clean": indices(0),
        "latents_history_2x": _latents(g, 2), "indices_latents_history_2x": indices(5, 6),
        "latents_history_4x": _latents(g, 4), "indices_latents_history_4x": indices(1, 2, 3, 4)}


def _tiny(name: str) -> Callable[..., tuple[Any, dict[str, Any]]]:
    def build(heads: int = HEADS, size: int = SIZE, frames: int = FRAMES) -> tuple[Any, dict[str, Any]]:
        from dsp_plugin.testing import tiny

        g = _g()
        if name == "wan":
            return tiny.tiny_wan(layers=2, heads=heads, head_dim=8), {
                "hidden_states": _latents(g, frames, size=size), "timestep": torch.tensor([3, 700]),
                "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g)}
        return tiny.tiny_latte(frames=FRAMES, layers=2, heads=HEADS, head_dim=4, sample_size=SIZE), {
            "hidden_states": _latents(g), "timestep": torch.tensor([3, 700]),
            "encoder_hidden_states": torch.randn(BATCH, TEXT, TEXT_DIM, generator=g)}

    return build


CASES: dict[str, Callable[..., tuple[Any, dict[str, Any]]]] = {
    "tiny-hunyuan-video": hunyuan_video,
    "tiny-ltx-video": ltx_video,
    "tiny-ltx-video-per-token": lambda: ltx_video(per_token=True),
    "tiny-mochi": mochi,
    "tiny-skyreels-v2": skyreels_v2,
    "tiny-skyreels-v2-df": lambda: skyreels_v2("df"),
    "tiny-skyreels-v2-causal": lambda: skyreels_v2("causal"),
    "tiny-easyanimate": easyanimate,
    "tiny-allegro": allegro,
    "tiny-consisid": consisid,
    "tiny-framepack": framepack,
    "tiny-wan": _tiny("wan"),
    "tiny-latte": _tiny("latte"),
}


def _more(module: str, name: str) -> Callable[..., tuple[Any, dict[str, Any]]]:
    def build(**shape: int) -> tuple[Any, dict[str, Any]]:
        import importlib

        return getattr(importlib.import_module(f"dsp_plugin.testing.{module}"), name)(**shape)

    return build


# the video transformers diffusers 0.42.1 added after the ones above (docs/models.md lists them all)
CASES.update({
    "tiny-wan-vace": _more("tiny_video_more", "wan_vace"),
    "tiny-wan-animate": _more("tiny_video_wan", "wan_animate"),
    "tiny-chronoedit": _more("tiny_video_wan", "chronoedit"),
    "tiny-anyflow": _more("tiny_video_wan", "anyflow"),
    "tiny-minimax-h3": _more("tiny_video_wan", "minimax_h3"),
    "tiny-ltx2": _more("tiny_video_wan", "ltx2"),
    "tiny-cosmos": _more("tiny_video_more", "cosmos"),
    "tiny-kandinsky5": _more("tiny_video_more", "kandinsky5"),
    "tiny-kandinsky6": _more("tiny_video_joint", "kandinsky6"),
    "tiny-motif-video": _more("tiny_video_joint", "motif_video"),
    "tiny-hunyuan-video15": _more("tiny_video_joint", "hunyuan_video15"),
    "tiny-sana-video": _more("tiny_video_joint", "sana_video"),
    "tiny-helios": _more("tiny_video_wan", "helios"),
    "tiny-flux": _more("tiny_image", "flux"),  # an image model (bench.cp_plan_models: it declares a _cp_plan)
})


def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast(v, dtype) for k, v in value.items()}
    return value


def case(name: str, dtype: torch.dtype = torch.float32, **shape: int) -> tuple[Any, dict[str, Any]]:
    """``CASES[name](**shape)`` in ``dtype`` (model and inputs), or a ValueError naming the known names. ``shape``
    (``heads``, ``size``, ``text``, ``frames``: where the case's builder takes them) changes the default shape."""
    if name not in CASES:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {', '.join(CASES)}")
    model, kwargs = CASES[name](**shape)
    return keep_fp32(model.to(dtype)), cast(kwargs, dtype)


def keep_fp32(model: Any) -> Any:
    """``model`` with its ``_keep_in_fp32_modules`` back in fp32, as ``from_pretrained(torch_dtype=...)`` loads it
    (a module whose name has one of them as a component), where the model fails without (Cosmos' learnable positions:
    a float64 input to their fp32 norm); other models are left in the dtype they were cast to. (Kandinsky 5 and
    Motif-Video fail in float64 either way: their time embeddings feed fp32 to layers of the model's dtype.)"""
    if type(model).__name__ != "CosmosTransformer3DModel":
        return model
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.float()
    return model
