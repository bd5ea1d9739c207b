"""``parallelize_latte_pipeline``: diffusers' ``LattePipeline`` sampled with its latents sharded on frames.

The flow and the scheduler rule are in ``dsp_plugin.pipelines.frame_sharded``; the transformer runs
through ``dsp_plugin.adapters.LatteDSP`` (the built-in Latte plan) on this rank's frames every step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler, guide

__all__ = ["DSPLattePipeline", "parallelize_latte_pipeline"]


class DSPLattePipeline(FrameShardedSampler):
    """A ``LattePipeline`` whose transformer runs on a frame shard; see the module docstring."""

    pipeline_class, entry = "LattePipeline", "parallelize_latte_pipeline"

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        from dsp_plugin.adapters.latte import LatteDSP

        super().__init__(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
        self.transformer = LatteDSP(pipe.transformer, group=dsp_group)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, negative_prompt: str | None = None, *,
                 prompt_embeds: torch.Tensor | None = None, negative_prompt_embeds: torch.Tensor | None = None,
                 video_length: int = 16, height: int = 512, width: int = 512,
                 num_inference_steps: int = 50, guidance_scale: float = 7.5, eta: float = 0.0,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil", mask_feature: bool = True, enable_temporal_attentions: bool = True,
                 decode_chunk_size: int | None = 14, return_dict: bool = True,
                 callback_on_step_end: Callable[[int, Any, torch.Tensor], None] | None = None) -> Any:
        """Same arguments and output as ``LattePipeline.__call__`` (``callback_on_step_end(i, t, shard)``)."""
        values = {k: v for k, v in locals().items() if k not in ("self", "callback_on_step_end")}
        from diffusers.pipelines.latte.pipeline_latte import LattePipelineOutput, retrieve_timesteps

        self.agree_call(values)
        pipe = self.pipe
        if eta != 0.0:
            raise ValueError(f"DSPLattePipeline: eta={eta} makes the scheduler step draw noise of the shard's "
                             f"shape; expected eta=0.0")
        pipe.check_inputs(prompt, height, width, negative_prompt, None, prompt_embeds, negative_prompt_embeds)
        do_cfg = self.check_call(video_length, "video_length", guidance_scale)
        device = pipe._execution_device
        prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
            prompt, do_cfg, negative_prompt=negative_prompt if negative_prompt is not None else "",
            num_images_per_prompt=1, device=device, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, clean_caption=False, mask_feature=mask_feature)
        cfg_parallel = do_cfg and self.cfg_group is not None
        if cfg_parallel:
            text = self.cfg_half(negative_prompt_embeds, prompt_embeds)
        elif do_cfg:
            text = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
        else:
            text = prompt_embeds

        timesteps, num_inference_steps = retrieve_timesteps(pipe.scheduler, num_inference_steps, device)
        batch = prompt_embeds.shape[0]
        full = pipe.prepare_latents(batch, pipe.transformer.config.in_channels, video_length, height, width,
                                    prompt_embeds.dtype, device, generator, latents)
        if generator is None and latents is None:
            full = self.share_noise(full)
        shard = self.shard(full)                                     # [B, C, T/N, h, w], kept to the end
        del full
        extra = pipe.prepare_extra_step_kwargs(generator, eta)
        learned_sigma = getattr(pipe.scheduler.config, "variance_type", None) in ("learned", "learned_range")

        for i, t in enumerate(timesteps):
            model_in = torch.cat([shard] * 2) if do_cfg and not cfg_parallel else shard
            model_in = pipe.scheduler.scale_model_input(model_in, t)
            step_t = t if torch.is_tensor(t) else torch.tensor([t], device=device)
            step_t = step_t.reshape(-1)[:1].to(device).expand(model_in.shape[0])
            noise = self.transformer.forward_shard(model_in, num_frames=video_length, timestep=step_t,
                                                   encoder_hidden_states=text,
                                                   enable_temporal_attentions=enable_temporal_attentions)
            if cfg_parallel:    # [B, C, T/N, h, w] from both halves -> [2, B, ...], one all_gather
                noise = self.cfg_combine(noise, guidance_scale)
            elif do_cfg:
                noise = guide(*noise.chunk(2), guidance_scale)
            if not learned_sigma:
                noise = noise.chunk(2, dim=1)[0]
            shard = pipe.scheduler.step(noise, t, shard, **extra, return_dict=False)[0]
            if callback_on_step_end is not None:
                callback_on_step_end(i, t, shard)

        video = self._finish(shard, video_length, decode_chunk_size, output_type)
        pipe.maybe_free_model_hooks()
        return LattePipelineOutput(frames=video) if return_dict else (video,)

    def _finish(self, shard: torch.Tensor, frames: int, decode_chunk_size: int | None, output_type: str) -> Any:
        """Gather once: the latents (``output_type="latent"``) or the decoded pixels of each rank's frames."""
        pipe = self.pipe
        if output_type in ("latent", "latents"):
            return self.unshard(shard, frames)
        chunk = decode_chunk_size or frames
        if "num_frames" in inspect.signature(pipe.vae.forward).parameters:   # a VAE that mixes frames
            video = pipe.decode_latents(self.unshard(shard, frames), frames, decode_chunk_size=chunk)
        else:                          # 2D VAE: decode local frames, gather pixels [B, 3, T, H, W]
            local = pipe.decode_latents(shard, shard.shape[2], decode_chunk_size=chunk)
            video = self.unshard(local, frames)
        return pipe.video_processor.postprocess_video(video=video, output_type=output_type)


def parallelize_latte_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                               cfg_group: dist.ProcessGroup | None = None) -> DSPLattePipeline:
    """Make a ``LattePipeline`` sample with DSP over ``dsp_group`` (and CFG halves over ``cfg_group``).

    ``dsp_group=None`` is the DSP group of the current topology (the whole world
    without one). Use ``sampling_groups`` to cut the world into CFG x DSP.
    """
    return DSPLattePipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)

