"""Multi-process sampling of diffusers pipelines, the latents sharded on frames from the first step to the last.

``frame_sharded`` holds what the samplers share (``FrameShardedSampler``: checks, groups, the shard,
the CFG exchange; ``sampling_groups`` to cut the world into CFG x DSP); ``latte_sampler``,
``wan_sampler`` and ``hunyuan_sampler`` each hold one pipeline's loop; ``planned_sampler`` takes any pipeline
whose transformer has a built-in plan, the latents whole (LTX-2, HunyuanVideo 1.5, Wan VACE, Kandinsky 5) (``wan_vae``: Wan's tiled VAE decode
split over the DSP ranks). ``python -m dsp_plugin.bench.latency`` measures their latency. Importing
this package needs torch only; diffusers is imported when a sampler is built.
See docs/inference.md.
"""

from __future__ import annotations

from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler, sampling_groups
from dsp_plugin.pipelines.hunyuan_sampler import DSPHunyuanVideoPipeline, parallelize_hunyuan_video_pipeline
from dsp_plugin.pipelines.latte_sampler import DSPLattePipeline, parallelize_latte_pipeline
from dsp_plugin.pipelines.planned_sampler import DSPPipeline, parallelize_pipeline
from dsp_plugin.pipelines.wan_sampler import DSPWanPipeline, parallelize_wan_pipeline

__all__ = ["DSPHunyuanVideoPipeline", "DSPLattePipeline", "DSPPipeline", "DSPWanPipeline", "FrameShardedSampler",
           "parallelize_hunyuan_video_pipeline", "parallelize_latte_pipeline", "parallelize_pipeline",
           "parallelize_wan_pipeline", "sampling_groups"]
