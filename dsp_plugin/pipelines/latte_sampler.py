"""``parallelize_latte_pipeline``: diffusers' ``LattePipeline`` through its own ``__call__``, latents frame-sharded.

The flow and the scheduler rule are in ``dsp_plugin.pipelines.frame_sharded``. Latte's transformer runs
with the built-in ``LATTE_PLAN`` (through ``dsp_plugin.adapters.LatteDSP``, which also checks its input) on
this rank's frames every step; with CFG the pipeline calls it once on ``[uncond; cond]``, so under CFG
parallelism each CFG rank runs its half of that batch. Latte's VAE is 2D: each rank decodes its own frames
(``decode_latents``) and the pixels are gathered, once.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler

__all__ = ["DSPLattePipeline", "parallelize_latte_pipeline"]


class DSPLattePipeline(FrameShardedSampler):
    """A ``LattePipeline`` whose transformer runs on a frame shard; see the module docstring."""

    pipeline_class, entry = "LattePipeline", "parallelize_latte_pipeline"
    frames_name = "video_length"

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        from dsp_plugin.adapters.latte import LatteDSP

        super().__init__(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
        self.adapter = LatteDSP(pipe.transformer, group=dsp_group)     # the plan's hooks, in place
        self.models = [pipe.transformer]

    def latent_frames(self, call: dict[str, Any]) -> int:
        return call["latents"].shape[2] if call.get("latents") is not None else call["video_length"]

    def check_call(self, call: dict[str, Any]) -> tuple[int, bool]:
        if call.get("eta", 0.0) != 0.0:
            raise ValueError(f"DSPLattePipeline: eta={call['eta']} makes the scheduler step draw noise of the "
                             f"shard's shape; expected eta=0.0")
        return super().check_call(call)

    def io_axes(self, model: Any, hidden_states: torch.Tensor, frames: int) -> dict[str, int]:
        self.adapter._check_input("DSPLattePipeline", hidden_states, frames)
        return {"T": frames}

    def decode_parts(self, frames: int) -> list[tuple[Any, str, Any]]:
        """A 2D VAE decodes this rank's frames and the pixels are gathered; a VAE that mixes frames
        (``num_frames`` in its forward) gets the gathered latents."""
        pipe, decode = self.pipe, self.pipe.decode_latents
        mixes_frames = "num_frames" in inspect.signature(pipe.vae.forward).parameters

        def sharded(latents: torch.Tensor, video_length: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            if mixes_frames:
                return decode(self.unshard(latents, frames), video_length, *args, **kwargs)
            return self.unshard(decode(latents, latents.shape[2], *args, **kwargs), frames)

        return [(pipe, "decode_latents", sharded)]


def parallelize_latte_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                               cfg_group: dist.ProcessGroup | None = None) -> DSPLattePipeline:
    """Make a ``LattePipeline`` sample with DSP over ``dsp_group`` (and CFG halves over ``cfg_group``).

    ``dsp_group=None`` is the DSP group of the current topology (the whole world
    without one). Use ``sampling_groups`` to cut the world into CFG x DSP.
    """
    return DSPLattePipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
