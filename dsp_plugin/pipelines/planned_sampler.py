"""Multi-process sampling of any stock diffusers pipeline whose transformer has a built-in plan, through its own
``__call__``, the latents whole on every rank.

``parallelize_pipeline(pipe, dsp_group=...)`` makes the pipeline's transformer(s) DSP-parallel in place
(``dsp_plugin.parallelize`` with the model's built-in plan, ``dsp_plugin.plan.builtin``) and returns a callable
that runs the pipeline's unmodified ``__call__`` (``FrameShardedSampler``'s checks and interception, without its
frame shard):

    prepare_*latents             drawn on every rank alike (a seeded generator), or on rank 0 and     a broadcast
                                 sent (no generator): the video's and, for LTX-2, the audio's         per tensor
    every step: the transformer  the plan splits the tokens at its first block, switches heads       all-to-alls,
                                 in attention and gathers the output at its last layer: the          one all_gather
                                 pipeline sees whole tensors                                          per stream
                scheduler.step   on the whole latents, every rank alike                               none
    end: the decode              every rank decodes the whole video (and audio)                       none

What it takes that the frame-sharded samplers (``wan_sampler``, ``hunyuan_sampler``, ``latte_sampler``) cannot:
a pipeline whose latents are packed tokens (LTX-2's ``[B, S, C]`` video and audio), channels-last
(Kandinsky 5's ``[B, F, H, W, C]``), or carry condition frames the pipeline concatenates itself (Wan VACE's
control video, HunyuanVideo 1.5's image condition): the plan, not the pipeline, decides where tokens split.
The cost: the per-step split and gather of the plan (the frame-sharded samplers keep the shard across steps).
Tested against the same pipeline on one process (``tests/test_sample_video_pipelines.py``): LTX2Pipeline,
HunyuanVideo15Pipeline, WanVACEPipeline, Kandinsky5T2VPipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.pipelines.frame_sharded import FrameShardedSampler

__all__ = ["DSPPipeline", "parallelize_pipeline"]


class DSPPipeline(FrameShardedSampler):
    """A stock diffusers pipeline whose transformer(s) run DSP-parallel under their built-in plan; see the module
    docstring. The scheduler check, the argument agreement across ranks and the noise sharing are the base's."""

    pipeline_class, entry = "DiffusionPipeline", "parallelize_pipeline"
    transformer_names = ("transformer", "transformer_2")

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None) -> None:
        import dsp_plugin
        from dsp_plugin.plan.builtin import builtin_plan

        super().__init__(pipe, dsp_group=dsp_group)
        present = {k: getattr(pipe, k, None) for k in self.transformer_names}
        present = {k: v for k, v in present.items() if isinstance(v, torch.nn.Module)}
        if not present:
            raise ValueError(f"{self.entry}: {type(pipe).__name__} has no transformer; expected a pipeline whose "
                             f"denoiser is its `transformer`")
        for name, model in present.items():       # every check before the first hook
            runtime = getattr(model, "_dsp_plan_runtime", None)
            if runtime is not None and runtime.group is not dsp_group:
                raise ValueError(f"{self.entry}: {name} is already parallelized over another group; expected the "
                                 f"same dsp_group, or a fresh pipeline")
            if runtime is None and builtin_plan(model) is None:
                raise ValueError(f"{self.entry}: {name} is a {type(model).__name__}, which has no built-in plan "
                                 f"(dsp_plugin.plan.builtin) and no diffusers _cp_plan; expected a model with one, "
                                 f"or parallelize it with your own plan first")
        for model in present.values():
            if getattr(model, "_dsp_plan_runtime", None) is None:
                dsp_plugin.parallelize(model, group=dsp_group)    # hooks in place: the model's own parameters
        self.models = list(present.values())

    def check_call(self, call: dict[str, Any]) -> tuple[int, bool]:
        """The arguments alike on every rank (the plan checks its own token counts against the group)."""
        self.agree_call({k: v for k, v in call.items() if k != "callback_on_step_end"})
        return 0, False

    def draws_unseeded(self, call: dict[str, Any]) -> bool:
        """No generator: whatever a ``prepare_*latents`` method draws is rank 0's on every rank (LTX-2 given its
        video latents still draws its audio noise)."""
        return call.get("generator") is None

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def unshard(self, shard: torch.Tensor, frames: int) -> torch.Tensor:
        return shard

    @contextlib.contextmanager
    def intercepted(self, frames: int, cfg_parallel: bool, share_noise: bool = False) -> Iterator[None]:
        """Without a generator, each ``prepare_*latents`` method's tensors are rank 0's on every rank (a broadcast
        each); with one, nothing is replaced: the transformer's hooks do the rest."""
        pipe = self.pipe
        names = [n for n in dir(type(pipe)) if share_noise and n.startswith("prepare_") and n.endswith("latents")]
        saved = {n: pipe.__dict__.get(n) for n in names}
        try:
            for name in names:
                object.__setattr__(pipe, name, self._shared(getattr(pipe, name)))
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    object.__delattr__(pipe, name)
                else:
                    object.__setattr__(pipe, name, value)

    def _shared(self, prepare: Any) -> Any:
        def shared(*args: Any, **kwargs: Any) -> Any:
            out = prepare(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(self.share_noise(t) if isinstance(t, torch.Tensor) else t for t in out)
            return self.share_noise(out) if isinstance(out, torch.Tensor) else out

        return shared


def parallelize_pipeline(pipe: Any, *, dsp_group: dist.ProcessGroup | None = None) -> DSPPipeline:
    """Make a stock diffusers pipeline sample with DSP over ``dsp_group`` (``None``: the current topology's DSP
    group, the whole world without one): its transformer(s) get their built-in plan's hooks in place; call the
    result with the pipeline's own ``__call__`` arguments. Pass a seeded generator alike on every rank."""
    return DSPPipeline(pipe, dsp_group=dsp_group)
