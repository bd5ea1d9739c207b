"""Tiny stock diffusers video pipelines whose transformers have a built-in plan: LTX-2 (video and audio),
HunyuanVideo 1.5, Wan VACE, Kandinsky 5 (text to video).

Each builder returns ``(pipe, call)``: the pipeline built from random tiny components (fp32, seeded, nothing
downloaded, no text encoder: ``call`` holds precomputed prompt embeddings) and the ``__call__`` arguments of a
2-step sample with classifier-free guidance, ``output_type="latent"`` left to the caller. Every pipeline saves
with ``save_pretrained`` and loads back with ``from_pretrained`` (the missing text encoders saved as ``None``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["PIPELINES", "SIZES", "pipeline_case", "save_case"]

#: the ``__call__`` arguments ``dsp-sample`` takes as flags (the rest go in ``call_args.pt``)
SIZES = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


def _g(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _wan_vae() -> Any:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
                            scale_factor_temporal=2, scale_factor_spatial=2).eval()


def wan_vace() -> tuple[Any, dict[str, Any]]:
    """``WanVACEPipeline``: ``tiny_video_more.wan_vace``'s model with 12 control channels (the control video's
    latents twice, 2x4, and the mask's 2x2 pixels per latent), the tiny Wan VAE (x2 in time and space), UniPC;
    no control video given: the pipeline's own blank one. 9 frames -> 5 latent frames, 16x16 pixels."""
    from diffusers import UniPCMultistepScheduler, WanVACEPipeline, WanVACETransformer3DModel

    from dsp_plugin.testing.tiny_video import HEADS, TEXT_DIM, fill_zeros

    torch.manual_seed(0)
    model = fill_zeros(WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, vace_layers=[0, 1],
        vace_in_channels=12))
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=_wan_vae(), transformer=model,
                           scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=3.0))
    g = _g()
    return pipe, {"prompt_embeds": torch.randn(1, 6, TEXT_DIM, generator=g),
                  "negative_prompt_embeds": torch.randn(1, 6, TEXT_DIM, generator=g),
                  "height": 16, "width": 16, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 4.0}


def hunyuan_video15() -> tuple[Any, dict[str, Any]]:
    """``HunyuanVideo15Pipeline`` (text to video): ``tiny_video_joint.hunyuan_video15``'s model taking the latents,
    the (zero) condition latents and the mask (4+4+1 channels), a tiny ``AutoencoderKLHunyuanVideo15`` (x2 in time
    and space), its guider's classifier-free guidance (scale 4), both text streams given (Qwen's and ByT5's, each
    padded). 9 frames -> 5 latent frames, 16x16 pixels."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    from dsp_plugin.testing.tiny_video import HEADS, TEXT_DIM, fill_zeros

    torch.manual_seed(0)
    model = fill_zeros(HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
        text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 4, 4), target_size=16, task_type="t2v"))
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(32, 32), layers_per_block=1,
                                      spatial_compression_ratio=2, temporal_compression_ratio=2).eval()
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=model, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
                                  tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=4.0))
    g = _g()

    def mask(tokens: int, valid: int) -> torch.Tensor:
        m = torch.zeros(1, tokens, dtype=torch.long)
        m[:, :valid] = 1
        return m

    return pipe, {"prompt_embeds": torch.randn(1, 6, TEXT_DIM, generator=g), "prompt_embeds_mask": mask(6, 4),
                  "prompt_embeds_2": torch.randn(1, 4, 8, generator=g), "prompt_embeds_mask_2": mask(4, 3),
                  "negative_prompt_embeds": torch.randn(1, 6, TEXT_DIM, generator=g),
                  "negative_prompt_embeds_mask": mask(6, 5),
                  "negative_prompt_embeds_2": torch.randn(1, 4, 8, generator=g),
                  "negative_prompt_embeds_mask_2": mask(4, 2),
                  "height": 16, "width": 16, "num_frames": 9, "num_inference_steps": 2}


def kandinsky5() -> tuple[Any, dict[str, Any]]:
    """``Kandinsky5T2VPipeline``: ``tiny_video_more.kandinsky5``'s model (channels-last latents), the tiny
    ``AutoencoderKLHunyuanVideo`` of ``tiny_video.hunyuan_video_pipeline`` (x4 in time, x2 in space), Qwen's and
    CLIP's embeddings given (``cu_seqlens`` of one prompt each). 17 frames -> 5 latent frames, 16x16 pixels."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

    from dsp_plugin.testing.tiny_video import TEXT_DIM, hunyuan_video_pipeline
    from dsp_plugin.testing.tiny_video_more import kandinsky5 as model

    vae = hunyuan_video_pipeline().vae
    pipe = Kandinsky5T2VPipeline(transformer=model()[0], vae=vae, text_encoder=None, tokenizer=None,
                                 text_encoder_2=None, tokenizer_2=None,
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    g = _g()
    return pipe, {"prompt_embeds_qwen": torch.randn(1, 6, TEXT_DIM, generator=g),
                  "prompt_embeds_clip": torch.randn(1, 8, generator=g),
                  "prompt_cu_seqlens": torch.tensor([0, 6], dtype=torch.int32),
                  "negative_prompt_embeds_qwen": torch.randn(1, 5, TEXT_DIM, generator=g),
                  "negative_prompt_embeds_clip": torch.randn(1, 8, generator=g),
                  "negative_prompt_cu_seqlens": torch.tensor([0, 5], dtype=torch.int32),
                  "height": 16, "width": 16, "num_frames": 17, "num_inference_steps": 2, "guidance_scale": 4.0}


def ltx2() -> tuple[Any, dict[str, Any]]:
    """``LTX2Pipeline`` (video and audio), sized as diffusers' own LTX-2 pipeline tests size it: a 2-layer
    transformer with audio-video cross-attention, its text connectors, a one-block video VAE (x2 in space and time),
    the audio VAE (8 mel bins) and the vocoder; Gemma's stacked hidden states given as ``prompt_embeds`` (2 layers
    of 32, left padded as Gemma's tokenizer pads). 9 frames -> 5 latent frames, 32x32 pixels (the pipeline takes multiples of 32), and
    the audio of the same 0.36 s."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    hidden, layers = 32, 2
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=hidden, rope_double_precision=False, rope_type="split")
    torch.manual_seed(1)
    connectors = LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=layers, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    torch.manual_seed(2)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    torch.manual_seed(3)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    torch.manual_seed(4)
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), audio_vae=audio_vae.eval(),
                        text_encoder=None, tokenizer=None, connectors=connectors.eval(), transformer=transformer,
                        vocoder=vocoder.eval())
    g = _g()

    def mask(valid: int) -> torch.Tensor:      # left padding
        m = torch.zeros(1, 8, dtype=torch.long)
        m[:, 8 - valid:] = 1
        return m

    return pipe, {"prompt_embeds": torch.randn(1, 8, hidden * layers, generator=g), "prompt_attention_mask": mask(6),
                  "negative_prompt_embeds": torch.randn(1, 8, hidden * layers, generator=g),
                  "negative_prompt_attention_mask": mask(5), "height": 32, "width": 32, "num_frames": 9,
                  "frame_rate": 25.0, "num_inference_steps": 2, "guidance_scale": 4.0, "audio_guidance_scale": 4.0,
                  "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
                  "spatio_temporal_guidance_blocks": None}


PIPELINES = {"ltx2": ltx2, "wan-vace": wan_vace, "hunyuan-video15": hunyuan_video15, "kandinsky5": kandinsky5}


def pipeline_case(name: str) -> tuple[Any, dict[str, Any]]:
    """``(pipe, call)`` of the tiny pipeline ``name`` (a key of ``PIPELINES``), its progress bar off."""
    pipe, call = PIPELINES[name]()
    pipe.set_progress_bar_config(disable=True)
    return pipe, call


def save_case(name: str, directory: str | Path) -> dict[str, Any]:
    """``save_pretrained`` of the tiny pipeline ``name`` into ``directory``, with ``call_args.pt`` beside its
    components: the call's prompt embeddings (what ``dsp-sample --call-args`` takes). Returns the whole call."""
    pipe, call = pipeline_case(name)
    pipe.save_pretrained(directory)
    torch.save({k: v for k, v in call.items() if k not in SIZES}, Path(directory) / "call_args.pt")
    return call


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsp_plugin.testing.tiny_pipelines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(PIPELINES))
    p.add_argument("directory")
    args = p.parse_args(argv)
    call = save_case(args.name, args.directory)
    sizes = " ".join(f"--{k.replace('_', '-')} {call[k]}" for k in ("num_frames", "height", "width"))
    print(f"wrote {args.directory} ({type(pipeline_case(args.name)[0]).__name__}) and its call_args.pt; sample it "
          f"with: dsp-sample --model {args.directory} --call-args {args.directory}/call_args.pt --steps 2 {sizes}")


if __name__ == "__main__":
    main()
