"""Multi-process sampling for diffusers' ``WanPipeline``, through its own ``__call__``, the latents sharded on frames.

``parallelize_wan_pipeline(pipe, dsp_group=..., cfg_group=...)`` makes the pipeline's transformer(s)
DSP-parallel in place (``dsp_plugin.parallelize``, the built-in ``WAN_PLAN``) and returns a callable that
runs ``WanPipeline.__call__`` unmodified with the parts of ``FrameShardedSampler`` intercepted:

    noise [B, C, F, h, w] --split F--> [B, C, F/N, h, w]         once, in prepare_latents
    every step: the transformer on the shard                     2 all-to-alls per layer (the head switch)
                (cond, then uncond: two calls, as WanPipeline)
                scheduler.step on the shard                      elementwise, no communication
    CFG parallel: the cond call runs on one CFG rank, the        one all_gather of the noise shard
                  uncond call on the other, exchanged
    end: gather the latents, decode on every rank               one all_gather, in vae.decode
         (Wan's VAE is causal in time: a frame's pixels depend on the frames before it)
         with vae.enable_tiling(): each rank decodes its spatial   one more all_gather (the tiles)
         tiles, every rank blends them (``wan_vae``)

F counts latent frames: ``(num_frames - 1) // vae_scale_factor_temporal + 1``. The pipeline's options run
as diffusers runs them: Wan 2.2's two-stage layout (``transformer_2`` and ``boundary_ratio``: both
transformers parallelized, each step on the one diffusers picks) and ``expand_timesteps`` (Wan 2.2 TI2V: a
timestep per token, built by the pipeline from the shard's latents, so per token of the shard).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.comm import group_size
from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler
from dsp_plugin.pipelines.wan_vae import split_tiled_decode

__all__ = ["DSPWanPipeline", "parallelize_wan_pipeline"]


class DSPWanPipeline(FrameShardedSampler):
    """A ``WanPipeline`` whose transformer(s) run on a latent frame shard; see the module docstring."""

    pipeline_class, entry = "WanPipeline", "parallelize_wan_pipeline"
    transformer_names, cfg_batched = ("transformer", "transformer_2"), False
    frames_name = "latent frames"

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        import dsp_plugin

        super().__init__(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
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

    def latent_frames(self, call: dict[str, Any]) -> int:
        """As ``WanPipeline`` rounds ``num_frames`` (it warns) and counts latent frames; else the latents'."""
        if call.get("latents") is not None:
            return call["latents"].shape[2]
        scale_t, num_frames = self.pipe.vae_scale_factor_temporal, call["num_frames"]
        if num_frames % scale_t != 1:
            num_frames = num_frames // scale_t * scale_t + 1
        return (max(num_frames, 1) - 1) // scale_t + 1

    def frames_hint(self, n: int) -> str:
        scale_t = self.pipe.vae_scale_factor_temporal
        return f" (num_frames >= {(n - 1) * scale_t + 1}: latent frames = (num_frames - 1) // {scale_t} + 1)"

    def io_axes(self, model: Any, hidden_states: torch.Tensor, frames: int) -> dict[str, int]:
        _, ph, pw = model.config.patch_size
        return {"F": frames, "HW": (hidden_states.shape[3] // ph) * (hidden_states.shape[4] // pw)}

    def decode_parts(self, frames: int) -> list[tuple[Any, str, Any]]:
        """``vae.decode`` on the gathered latents (one all_gather), with its spatial tiles split over the DSP ranks.

        Wan's VAE is causal in time (a feature cache carried from frame to frame): a frame's pixels depend on
        every earlier latent frame, so the frames cannot be decoded apart; the latents are gathered first. With
        ``vae.enable_tiling()`` and latents larger than one tile (``_decode``'s own test, which still decides),
        ``vae.tiled_decode`` is replaced for the call: each rank decodes its share of the spatial tiles through
        every frame and the tiles are exchanged in one more all_gather (``wan_vae.split_tiled_decode``, equal to
        diffusers' ``tiled_decode``). Without tiling, or within one tile, every rank decodes the whole video.
        """
        vae = self.pipe.vae
        parts: list[tuple[Any, str, Any]] = [self.gathered_decode(frames)]
        if group_size(self.dsp_group) > 1:
            def split(z: torch.Tensor, return_dict: bool = True) -> Any:
                return split_tiled_decode(vae, z, return_dict, group=self.dsp_group)

            parts.append((vae, "tiled_decode", split))
        return parts


def parallelize_wan_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                             cfg_group: dist.ProcessGroup | None = None) -> DSPWanPipeline:
    """Make a ``WanPipeline`` sample with DSP over ``dsp_group`` (and CFG halves over ``cfg_group``).

    The pipeline's transformer (and ``transformer_2``) get DSP hooks in place.
    ``dsp_group=None`` is the DSP group of the current topology (the whole world
    without one). Use ``dsp_plugin.pipelines.sampling_groups`` to cut the world into CFG x DSP.
    """
    return DSPWanPipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
