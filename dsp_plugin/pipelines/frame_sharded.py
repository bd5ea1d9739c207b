"""Multi-process sampling for diffusers pipelines: latents sharded from the first step to the last.

``parallelize_latte_pipeline(pipe, dsp_group=..., cfg_group=...)`` (``latte_sampler``) and
``parallelize_wan_pipeline`` (``wan_sampler``) return a
callable with the pipeline's ``__call__`` arguments that runs the same algorithm
(the pipeline's own ``encode_prompt``, ``prepare_latents``, scheduler, VAE
decode and ``video_processor``) with the latents split once on the frame dim:

    noise [B, C, T, h, w] --split T--> [B, C, T/N, h, w]        once, before step 0
    every step: the transformer on the shard                    all-to-alls only, no gather
                scheduler.step on the shard                     elementwise, no communication
    CFG parallel: the cond and uncond halves on a 2-way axis,   one all_gather of the noise shard
                  combined on both halves                       (size of the latent shard)
    end: decode this rank's frames (2D VAE), gather pixels      one all_gather
         (a VAE that mixes frames gets the gathered latents instead)

Every rank ends with the full video. The scheduler's step must be
deterministic (DDIM with ``eta=0``, DPM-Solver, UniPC, Euler, ...): a stochastic
step would draw noise of the shard's shape and the sample would depend on N.
``FrameShardedSampler`` holds what the pipelines share (checks, groups, the
shard, the CFG exchange); each pipeline's class holds its own loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.comm import agree_inputs, gather, group_rank, group_size, split
from dsp_plugin.comm.collectives import broadcast
from dsp_plugin.comm.group_resolution import _resolve_group, check_launched_alone

__all__ = ["FrameShardedSampler", "guide", "sampling_groups"]

#: what a sampler's input mismatch (``checks.InputMismatch``) tells the user to do
SAMPLER_HINT = ("Pass the same prompt, embeddings, sizes and latents on every rank, and a generator seeded alike "
                "(torch.Generator().manual_seed(seed) with the same seed); without a generator the noise is drawn "
                "once, on rank 0, and shared.")

STOCHASTIC_SCHEDULERS = ("DDPMScheduler", "EulerAncestralDiscreteScheduler", "KDPM2AncestralDiscreteScheduler",
                         "DPMSolverSDEScheduler", "LCMScheduler", "TCDScheduler")


class FrameShardedSampler:
    """The part every frame-sharded sampler shares: the checks (each raised on every rank before any
    collective), the DSP and CFG groups, the split and gather of the frames, and the CFG exchange."""

    pipeline_class = ""      # the diffusers pipeline class this sampler takes
    entry = ""               # the public function, named in errors

    def __init__(self, pipe: Any, *, dsp_group: dist.ProcessGroup | None = None,
                 cfg_group: dist.ProcessGroup | None = None) -> None:
        import diffusers

        if not isinstance(pipe, getattr(diffusers, self.pipeline_class)):
            raise TypeError(f"{self.entry}: expected a diffusers {self.pipeline_class}, got {type(pipe).__name__}")
        if cfg_group is not None and group_size(cfg_group) not in (1, 2):
            raise ValueError(f"{self.entry}: the CFG group has {group_size(cfg_group)} ranks; "
                             f"expected 2 (conditional and unconditional halves) or 1")
        config = pipe.scheduler.config
        name = type(pipe.scheduler).__name__
        if (name in STOCHASTIC_SCHEDULERS or str(getattr(config, "algorithm_type", "")).startswith("sde")
                or getattr(config, "stochastic_sampling", False)):
            raise ValueError(f"{self.entry}: scheduler {name} draws noise in its step, which on a "
                             f"shard would depend on the DSP size; expected a deterministic scheduler "
                             f"(DDIM with eta=0, DPMSolverMultistep, UniPC, EulerDiscrete, FlowMatchEuler "
                             f"without stochastic_sampling, ...)")
        self.pipe = pipe
        self.dsp_group = dsp_group
        self.cfg_group = cfg_group if cfg_group is not None and group_size(cfg_group) == 2 else None

    def check_call(self, frames: int, what: str, guidance_scale: float, hint: str = "") -> bool:
        """Refuse a frame count below the DSP size and a CFG group without guidance; return ``do_cfg``."""
        n = group_size(self.dsp_group)
        if frames < n:
            raise ValueError(f"{type(self).__name__}: {what}={frames} is smaller than the DSP size {n}; "
                             f"expected {what} >= {n}{hint}")
        do_cfg = guidance_scale > 1.0
        if self.cfg_group is not None and not do_cfg:
            raise ValueError(f"{type(self).__name__}: guidance_scale={guidance_scale} turns classifier-free "
                             f"guidance off, but the CFG group has 2 ranks; expected guidance_scale > 1 or "
                             f"cfg_group=None")
        return do_cfg

    def agree_call(self, values: dict[str, Any]) -> None:
        """The call's arguments are alike on every rank of the DSP and the CFG group, else ``InputMismatch``
        on every rank naming them (every call: prompts change from call to call; not under ``DSP_CHECK=0``)."""
        name = type(self).__name__
        for group in (_resolve_group(self.dsp_group, self.entry), self.cfg_group):
            agree_inputs(name, values, group=group, hint=SAMPLER_HINT, every_call=True)

    def share_noise(self, full: torch.Tensor) -> torch.Tensor:
        """The noise rank 0 drew, on every rank: without a generator each process draws from its own default
        generator (seeded differently per process), so it is drawn once and sent (a broadcast per group)."""
        for group in (_resolve_group(self.dsp_group, self.entry), self.cfg_group):
            if group is not None and dist.get_world_size(group) > 1:
                full = full.contiguous()
                broadcast(full, group=group)
        return full

    def cfg_half(self, uncond: Any, cond: Any) -> Any:
        """Under CFG parallelism: CFG rank 0 runs the unconditional half, rank 1 the conditional one."""
        return uncond if group_rank(self.cfg_group) == 0 else cond

    def cfg_combine(self, noise: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """This rank's half of the guided noise, both halves exchanged with one all_gather."""
        uncond, cond = gather(noise.unsqueeze(0).contiguous(), 0, group=self.cfg_group, global_len=2)
        return guide(uncond, cond, guidance_scale)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, h, w]`` -> this rank's frames ``[B, C, T/N, h, w]`` (no communication)."""
        return split(full, 2, group=self.dsp_group)

    def unshard(self, shard: torch.Tensor, frames: int) -> torch.Tensor:
        """All frames back on every rank: one all_gather along dim 2."""
        return gather(shard.contiguous(), 2, group=self.dsp_group, global_len=frames)


def guide(uncond: torch.Tensor, cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance, in the order diffusers' pipelines compute it."""
    return uncond + guidance_scale * (cond - uncond)



def sampling_groups(*, cfg_parallel: bool) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(dsp_group, cfg_group) for this process: the world as CFG(2) x DSP, DSP ranks adjacent.

    Built with ``Topology.build`` (the CFG axis takes the data-parallel slot:
    both halves hold the same latents, as data-parallel replicas hold the same
    parameters). Without torch.distributed: (None, None).
    """
    if not (dist.is_available() and dist.is_initialized()):
        check_launched_alone("sampling_groups")
        return None, None
    from dsp_plugin.topology import Topology, set_topology

    world = dist.get_world_size()
    cfg = 2 if cfg_parallel else 1
    if world % cfg:
        raise ValueError(f"sampling_groups: CFG parallelism needs an even world size, got {world}")
    topology = Topology.build(dsp=world // cfg)
    set_topology(topology)
    return topology.dsp_group, (topology.dp_group if cfg_parallel else None)
