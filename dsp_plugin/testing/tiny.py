"""Tiny random-weight diffusers models and a LattePipeline, built locally (nothing is downloaded).

Shared by the tests, ``dsp_plugin/launch/sample_latte.py`` and the latency command, so all
three sample the same pipeline. Weights come from ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compile_case", "tiny_latte", "tiny_latte_pipeline", "tiny_prompt_embeds", "tiny_spatiotemporal",
           "tiny_wan", "tiny_wan_pipeline"]

CAPTION_CHANNELS = 16


def tiny_latte(*, frames: int = 7, layers: int = 2, heads: int = 2, head_dim: int = 8, sample_size: int = 8,
               seed: int = 0) -> Any:
    """A ``LatteTransformer3DModel`` with ``out_channels = 2 * in_channels`` (learned sigma, as Latte-1)."""
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8, num_layers=layers,
        sample_size=sample_size, patch_size=2, caption_channels=CAPTION_CHANNELS,
        cross_attention_dim=heads * head_dim, video_length=frames, norm_type="ada_norm_single",
        num_embeds_ada_norm=1000, activation_fn="gelu-approximate")
    # scale_shift_table and the zero-initialised adaLN let every path carry signal
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def tiny_latte_pipeline(*, frames: int = 7, layers: int = 2, sample_size: int = 8, seed: int = 0,
                        pretrained: str | None = None) -> Any:
    """A ``LattePipeline`` (tiny transformer, tiny 2D ``AutoencoderKL``, DDIM, no text encoder).

    ``pretrained``: a directory written by ``save_pretrained`` of such a pipeline;
    loaded with diffusers' own ``from_pretrained`` (local files only).
    """
    from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline

    if pretrained is not None:
        return LattePipeline.from_pretrained(pretrained, local_files_only=True, torch_dtype=torch.float32)
    transformer = tiny_latte(frames=frames, layers=layers, sample_size=sample_size, seed=seed)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=4, norm_num_groups=4, sample_size=2 * sample_size)
    return LattePipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                         scheduler=DDIMScheduler())


def tiny_prompt_embeds(*, batch: int = 1, tokens: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds, negative_prompt_embeds) standing in for T5 outputs."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, tokens, CAPTION_CHANNELS, generator=g),
            torch.randn(batch, tokens, CAPTION_CHANNELS, generator=g))


def tiny_spatiotemporal(*, layers: int = 2, channels: int = 32, heads: int = 2, head_dim: int = 16,
                        cross_dim: int = 16, seed: int = 0) -> Any:
    """A ``TransformerSpatioTemporalModel`` (SVD's); the model needs heads * head_dim == channels."""
    from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

    torch.manual_seed(seed)
    model = TransformerSpatioTemporalModel(num_attention_heads=heads, attention_head_dim=head_dim,
                                           in_channels=channels, num_layers=layers, cross_attention_dim=cross_dim)
    with torch.no_grad():
        for p in model.parameters():           # zero-initialised projections would hide the blocks
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
        model.time_mixer.mix_factor.fill_(0.3)  # a mixer that weights both paths unequally
    return model


def tiny_wan(*, layers: int = 2, heads: int = 3, head_dim: int = 8, text_dim: int = 16, seed: int = 0) -> Any:
    """A ``WanTransformer3DModel`` (Wan 2.1 text-to-video layout): patch (1, 2, 2), 4 latent channels."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                  in_channels=4, out_channels=4, text_dim=text_dim, freq_dim=16, ffn_dim=32,
                                  num_layers=layers, cross_attn_norm=True, rope_max_seq_len=32)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised tables would hide a path
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def tiny_wan_pipeline(*, layers: int = 2, seed: int = 0, two_stage: bool = False) -> Any:
    """A ``WanPipeline``: ``tiny_wan``, a tiny ``AutoencoderKLWan`` (x2 in time and space), a tiny UMT5 encoder
    and a word-level tokenizer built in memory, UniPC (Wan's own scheduler, deterministic). Nothing is downloaded.

    ``two_stage``: Wan 2.2's layout, a second transformer for the low-noise steps (``boundary_ratio=0.8``:
    with 2 UniPC steps, t=999 runs on ``transformer`` and t=750 on ``transformer_2``)..
    Height and width must be multiples of 16 (the pipeline's check); latent frames = (num_frames - 1) // 2 + 1.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "walks", "runs", "on", "the", "grass", "beach", "blurry"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=CAPTION_CHANNELS, d_kv=8, d_ff=32,
                                               num_layers=1, num_heads=2, relative_attention_num_buckets=8))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
                           scale_factor_temporal=2, scale_factor_spatial=2)
    second = tiny_wan(layers=layers, text_dim=CAPTION_CHANNELS, seed=seed + 2) if two_stage else None
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       transformer=tiny_wan(layers=layers, text_dim=CAPTION_CHANNELS, seed=seed),
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         flow_shift=3.0),
                       transformer_2=second, boundary_ratio=0.8 if two_stage else None)


def compile_case(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """(model, args, kwargs) of the compile checks and the bench's compile rows: the reference STDiT
    (``"stdit"``), the tiny Wan (``"wan"``) or the tiny Latte (``"latte"``) on 2 samples of 5 frames 6x6."""
    g = torch.Generator().manual_seed(1)
    if name == "stdit":
        from dsp_plugin.models.stdit import STDiT, STDiTConfig

        torch.manual_seed(0)
        return (STDiT(STDiTConfig.preset("tiny", axes=2)),
                (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g)),
                {})
    if name == "latte":
        return (tiny_latte(frames=5, layers=2, heads=3, head_dim=4, sample_size=6),
                (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 7, 16, generator=g)),
                {"return_dict": False})
    return (tiny_wan(layers=2, heads=3, head_dim=8),
            (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 7, 16, generator=g)),
            {"return_dict": False})
