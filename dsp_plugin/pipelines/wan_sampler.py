"""Multi-process sampling for diffusers' ``WanPipeline``: latents sharded on frames from the first step to the last.

``parallelize_wan_pipeline(pipe, dsp_group=..., cfg_group=...)`` returns a
callable with ``WanPipeline.__call__``'s arguments that runs the pipeline's own
``encode_prompt``, ``prepare_latents``, scheduler, VAE decode and
``video_processor``, with the transformer made DSP-parallel in place
(``dsp_plugin.parallelize``, the built-in ``WAN_PLAN``) and called under
``sharded_io`` on this rank's latent frames every step:

    noise [B, C, F, h, w] --split F--> [B, C, F/N, h, w]         once, before step 0
    every step: the transformer on the shard                     2 all-to-alls per layer (the head switch)
                (cond, then uncond: two calls, as WanPipeline)
                scheduler.step on the shard                      elementwise, no communication
    CFG parallel: cond on one half of a 2-way axis, uncond on    one all_gather of the noise shard
                  the other, combined on both
    end: gather the latents, decode on every rank               one all_gather
         (Wan's VAE is causal in time: a frame's pixels depend on the frames before it)

F counts latent frames: ``(num_frames - 1) // vae_scale_factor_temporal + 1``.
Wan 2.2's two-stage layout (``transformer_2`` and ``boundary_ratio``) has both
transformers parallelized, each step running the one diffusers would.
Shared checks and the CFG exchange: ``dsp_plugin.pipelines.frame_sharded.FrameShardedSampler``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.comm import group_size
from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler, guide
from dsp_plugin.plan import sharded_io

__all__ = ["DSPWanPipeline", "parallelize_wan_pipeline"]


class DSPWanPipeline(FrameShardedSampler):
    """A ``WanPipeline`` whose transformer(s) run on a latent frame shard; see the module docstring."""

    pipeline_class, entry = "WanPipeline", "parallelize_wan_pipeline"

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        import dsp_plugin

        super().__init__(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
        if pipe.config.expand_timesteps:
            raise ValueError(f"{self.entry}: expand_timesteps=True (Wan 2.2 TI2V) gives every token its own "
                             f"timestep, which the Wan plan does not shard; expected expand_timesteps=False")
        named = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
        if pipe.config.boundary_ratio is not None and None in named.values():
            missing = next(k for k, v in named.items() if v is None)
            raise ValueError(f"{self.entry}: boundary_ratio={pipe.config.boundary_ratio} switches between two "
                             f"transformers, but the pipeline's {missing} is None; expected both")
        present = {k: v for k, v in named.items() if v is not None}
        if not present:
            raise ValueError(f"{self.entry}: the pipeline has no transformer; expected a WanTransformer3DModel")
        for name, model in present.items():     # every check before the first hook
            if tuple(model.config.patch_size)[0] != 1:
                raise ValueError(f"{self.entry}: {name}.config.patch_size={tuple(model.config.patch_size)} "
                                 f"patches frames together; expected a temporal patch size of 1 (Wan 2.1, 2.2)")
            runtime = getattr(model, "_dsp_plan_runtime", None)
            if runtime is not None and runtime.group is not dsp_group:
                raise ValueError(f"{self.entry}: {name} is already parallelized over another group; expected "
                                 f"the same dsp_group, or a fresh pipeline")
        for model in present.values():
            if getattr(model, "_dsp_plan_runtime", None) is None:
                dsp_plugin.parallelize(model, group=dsp_group)     # hooks in place: the model's own parameters
        self.models = list(present.values())

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, negative_prompt: str | list[str] | None = None,
                 height: int = 480, width: int = 832, num_frames: int = 81, num_inference_steps: int = 50,
                 guidance_scale: float = 5.0, guidance_scale_2: float | None = None,
                 num_videos_per_prompt: int = 1, generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None, prompt_embeds: torch.Tensor | None = None,
                 negative_prompt_embeds: torch.Tensor | None = None, output_type: str = "np",
                 return_dict: bool = True, attention_kwargs: dict[str, Any] | None = None,
                 callback_on_step_end: Callable[[int, Any, torch.Tensor], None] | None = None,
                 max_sequence_length: int = 512) -> Any:
        """Same arguments and output as ``WanPipeline.__call__`` (``callback_on_step_end(i, t, shard)``)."""
        values = {k: v for k, v in locals().items() if k not in ("self", "callback_on_step_end")}
        from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

        self.agree_call(values)
        pipe, first = self.pipe, self.models[0]
        pipe.check_inputs(prompt, negative_prompt, height, width, prompt_embeds, negative_prompt_embeds, None,
                          guidance_scale_2)
        scale_t, scale_s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        if num_frames % scale_t != 1:      # rounded as WanPipeline rounds it (it warns)
            num_frames = num_frames // scale_t * scale_t + 1
        num_frames = max(num_frames, 1)
        _, ph, pw = first.config.patch_size
        height, width = height // (scale_s * ph) * scale_s * ph, width // (scale_s * pw) * scale_s * pw
        frames = latents.shape[2] if latents is not None else (num_frames - 1) // scale_t + 1
        n = group_size(self.dsp_group)
        do_cfg = self.check_call(frames, "latent frames", guidance_scale,
                                 f" (num_frames >= {(n - 1) * scale_t + 1}: latent frames = "
                                 f"(num_frames - 1) // {scale_t} + 1)")
        boundary = pipe.config.boundary_ratio
        if boundary is not None and guidance_scale_2 is None:
            guidance_scale_2 = guidance_scale
        device = pipe._execution_device
        # WanPipeline's batch: the prompts, else the given embeddings (num_videos_per_prompt latents each)
        batch = 1 if isinstance(prompt, str) else len(prompt) if prompt is not None else prompt_embeds.shape[0]
        prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
            prompt=prompt, negative_prompt=negative_prompt, do_classifier_free_guidance=do_cfg,
            num_videos_per_prompt=num_videos_per_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length, device=device)
        dtype = first.dtype
        texts = {"cond": prompt_embeds.to(dtype)}
        if do_cfg:
            texts["uncond"] = negative_prompt_embeds.to(dtype)
        cfg_parallel = do_cfg and self.cfg_group is not None
        if cfg_parallel:   # this rank's half only
            name = self.cfg_half("uncond", "cond")
            texts = {name: texts[name]}

        pipe.scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = pipe.scheduler.timesteps
        full = pipe.prepare_latents(batch * num_videos_per_prompt, first.config.in_channels, height, width,
                                    num_frames, torch.float32, device, generator, latents)
        if generator is None and latents is None:
            full = self.share_noise(full)
        hw = (full.shape[3] // ph) * (full.shape[4] // pw)
        shard = self.shard(full)                                    # [B, C, F/N, h, w], kept to the end
        del full
        pipe.scheduler.set_begin_index(0)
        boundary_t = None if boundary is None else boundary * pipe.scheduler.config.num_train_timesteps

        for i, t in enumerate(timesteps):
            if boundary_t is None or t >= boundary_t:
                model, scale = pipe.transformer, guidance_scale
            else:
                model, scale = pipe.transformer_2, guidance_scale_2
            cache = {"step_index": i, "sigma": float(pipe.scheduler.sigmas[i]), "num_inference_steps": len(timesteps)}
            x, timestep = shard.to(dtype), t.expand(shard.shape[0])
            noise = {}
            for name, text in texts.items():
                with model.cache_context(name, **cache), sharded_io(F=frames, HW=hw):
                    noise[name] = model(hidden_states=x, timestep=timestep, encoder_hidden_states=text,
                                        attention_kwargs=attention_kwargs, return_dict=False)[0]
            if cfg_parallel:
                pred = self.cfg_combine(next(iter(noise.values())), scale)
            elif do_cfg:
                pred = guide(noise["uncond"], noise["cond"], scale)
            else:
                pred = noise["cond"]
            shard = pipe.scheduler.step(pred, t, shard, return_dict=False)[0]
            if callback_on_step_end is not None:
                callback_on_step_end(i, t, shard)

        video = self.unshard(shard, frames)                        # the one gather
        if output_type != "latent":
            video = self._decode(video, output_type)
        pipe.maybe_free_model_hooks()
        return WanPipelineOutput(frames=video) if return_dict else (video,)

    def _decode(self, latents: torch.Tensor, output_type: str) -> Any:
        """``WanPipeline``'s decode, on the gathered latents (the causal VAE needs every earlier frame)."""
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = self.pipe.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type=output_type)


def parallelize_wan_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                             cfg_group: dist.ProcessGroup | None = None) -> DSPWanPipeline:
    """Make a ``WanPipeline`` sample with DSP over ``dsp_group`` (and CFG halves over ``cfg_group``).

    The pipeline's transformer (and ``transformer_2``) get DSP hooks in place.
    ``dsp_group=None`` is the DSP group of the current topology (the whole world
    without one). Use ``dsp_plugin.pipelines.sampling_groups`` to cut the world into CFG x DSP.
    """
    return DSPWanPipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
