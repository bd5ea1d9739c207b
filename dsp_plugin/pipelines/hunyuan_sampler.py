"""Multi-process sampling for diffusers' ``HunyuanVideoPipeline``, through its own ``__call__``, the latents sharded
on frames.

``parallelize_hunyuan_video_pipeline(pipe, dsp_group=..., cfg_group=...)`` makes the pipeline's transformer
DSP-parallel in place (``dsp_plugin.parallelize`` with ``HUNYUAN_VIDEO_FRAMES_PLAN``: whole frames) and returns a
callable that runs ``HunyuanVideoPipeline.__call__`` unmodified with the parts of ``FrameShardedSampler``
intercepted:

    noise [B, C, F, h, w] --split F--> [B, C, F/N, h, w]         once, in prepare_latents
    every step: the transformer on the shard                     2 all-to-alls per attention (the head switch),
                                                                 1 small all_gather of the text mask's video
                                                                 columns (the model builds its key-padding mask
                                                                 from the tokens it is fed; plan/masks.py)
                (cond, then uncond with true CFG: two calls)
                scheduler.step on the shard                      elementwise, no communication
    CFG parallel (true_cfg_scale > 1 and a negative prompt):     one all_gather of the noise shard
                  the cond call runs on one CFG rank, the
                  uncond call on the other, exchanged
    end: gather the latents, decode on every rank               one all_gather, in vae.decode
         (AutoencoderKLHunyuanVideo is causal in time)

F counts latent frames: ``(num_frames - 1) // vae_scale_factor_temporal + 1``. ``guidance_scale`` is the
guidance-distilled model's embedded guidance (HunyuanVideo T2V): a per-sample input every rank passes alike,
not classifier-free guidance; true CFG is ``true_cfg_scale`` with a negative prompt, as diffusers decides it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler

__all__ = ["DSPHunyuanVideoPipeline", "parallelize_hunyuan_video_pipeline"]


class DSPHunyuanVideoPipeline(FrameShardedSampler):
    """A ``HunyuanVideoPipeline`` whose transformer runs on a latent frame shard; see the module docstring."""

    pipeline_class, entry = "HunyuanVideoPipeline", "parallelize_hunyuan_video_pipeline"
    cfg_batched = False
    frames_name = "latent frames"

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        import dsp_plugin
        from dsp_plugin.plan.builtin import hunyuan_video_frames_plan

        super().__init__(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
        model = pipe.transformer
        if model is None:
            raise ValueError(f"{self.entry}: the pipeline has no transformer; expected a "
                             f"HunyuanVideoTransformer3DModel")
        if model.config.patch_size_t != 1:     # every check before the first hook
            raise ValueError(f"{self.entry}: transformer.config.patch_size_t={model.config.patch_size_t} patches "
                             f"frames together; expected a temporal patch size of 1 (HunyuanVideo)")
        plan = hunyuan_video_frames_plan(model)
        runtime = getattr(model, "_dsp_plan_runtime", None)
        if runtime is not None and (runtime.group is not dsp_group or runtime.plan is not plan):
            raise ValueError(f"{self.entry}: the transformer is already parallelized (over another group, or with "
                             f"another plan than HUNYUAN_VIDEO_FRAMES_PLAN, such as the default flat split); "
                             f"expected a fresh pipeline")
        if runtime is None:
            dsp_plugin.parallelize(model, plan, group=dsp_group)   # hooks in place: the model's own parameters
        self.models = [model]

    def latent_frames(self, call: dict[str, Any]) -> int:
        """As ``HunyuanVideoPipeline.prepare_latents`` counts them; else the latents'."""
        if call.get("latents") is not None:
            return call["latents"].shape[2]
        return (call["num_frames"] - 1) // self.pipe.vae_scale_factor_temporal + 1

    def frames_hint(self, n: int) -> str:
        scale_t = self.pipe.vae_scale_factor_temporal
        return f" (num_frames >= {(n - 1) * scale_t + 1}: latent frames = (num_frames - 1) // {scale_t} + 1)"

    def cfg_enabled(self, call: dict[str, Any]) -> tuple[bool, str, str]:
        """diffusers' own rule: ``true_cfg_scale > 1`` and a negative prompt (text or embeddings)."""
        scale = call.get("true_cfg_scale", 1.0)
        negative = call.get("negative_prompt") is not None or (
            call.get("negative_prompt_embeds") is not None and call.get("negative_pooled_prompt_embeds") is not None)
        why = f"true_cfg_scale={scale}" + ("" if negative else " without a negative prompt")
        return scale > 1 and negative, why, ("true_cfg_scale > 1 with negative_prompt (or negative_prompt_embeds "
                                             "and negative_pooled_prompt_embeds)")

    def io_axes(self, model: Any, hidden_states: torch.Tensor, frames: int) -> dict[str, int]:
        p = model.config.patch_size
        return {"F": frames, "HW": (hidden_states.shape[3] // p) * (hidden_states.shape[4] // p)}

    def decode_parts(self, frames: int) -> list[tuple[Any, str, Any]]:
        """``vae.decode`` on the gathered latents (the causal VAE needs every earlier frame): one all_gather."""
        return [self.gathered_decode(frames)]


def parallelize_hunyuan_video_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                                       cfg_group: dist.ProcessGroup | None = None) -> DSPHunyuanVideoPipeline:
    """Make a ``HunyuanVideoPipeline`` sample with DSP over ``dsp_group`` (and CFG halves over ``cfg_group``).

    The pipeline's transformer gets DSP hooks in place. ``dsp_group=None`` is the DSP group of the current
    topology (the whole world without one). Use ``dsp_plugin.pipelines.sampling_groups`` to cut the world into
    CFG x DSP; CFG parallelism needs ``true_cfg_scale > 1`` and a negative prompt.
    """
    return DSPHunyuanVideoPipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
