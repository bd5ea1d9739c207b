"""Multi-process sampling through diffusers' own ``__call__``: the latents sharded on frames from first step to last.

``parallelize_latte_pipeline(pipe, dsp_group=..., cfg_group=...)`` (``latte_sampler``),
``parallelize_wan_pipeline`` (``wan_sampler``) and ``parallelize_hunyuan_video_pipeline``
(``hunyuan_sampler``) return a callable that takes the pipeline's
``__call__`` arguments and runs the pipeline's unmodified ``__call__`` (its loop, progress bar,
callbacks and options) with a few of its parts intercepted for the duration of the call:

    pipe.prepare_latents        noise [B, C, T, h, w] --split T--> [B, C, T/N, h, w]     once, no communication
    pipe.transformer(...)       the DSP-parallel model on the shard (``sharded_io``)     all-to-alls only
    scheduler.step              on the shard, untouched                               elementwise
    CFG parallel                each CFG rank runs one half; the halves exchanged     one all_gather per step
    the decode                  a per-frame VAE decodes this rank's frames, pixels gathered; a VAE that mixes
                                frames (Wan's causal one) gets the gathered latents   one all_gather
    output_type="latent"        the latents gathered after the loop                    one all_gather

The transformer is reached through a stand-in placed on the pipeline for the call (``object.__setattr__``, so
the pipeline's config is untouched); everything else the pipeline reads from it is the model's own. The
progress bar is diffusers' own (rank 0 only, unless ``set_progress_bar_config(disable=False)``). Every rank
ends with the full video. The scheduler's step must be deterministic (DDIM with ``eta=0``, DPM-Solver, UniPC,
Euler, ...): a stochastic step would draw noise of the shard's shape and the sample would depend on N. Each
pipeline's class (``latte_sampler``, ``wan_sampler``) says which parts it intercepts; the entry checks of
every call are in ``FrameShardedSampler.check_call``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
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
    """What every frame-sharded sampler shares: the checks (each raised on every rank before any collective),
    the DSP and CFG groups, the interception of the pipeline's parts for one call, the split and gather of the
    frames and the CFG exchange. A subclass names its pipeline, its transformers, ``io_axes``, ``latent_frames``
    and its decode interception."""

    pipeline_class = ""      # the diffusers pipeline class this sampler takes
    entry = ""               # the public function, named in errors
    transformer_names: tuple[str, ...] = ("transformer",)
    cfg_batched = True       # CFG as one call on [uncond; cond] (Latte); False: a cond call then an uncond call
                             # (Wan, HunyuanVideo)

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
        self.models: list[Any] = []
        self._signature = inspect.signature(type(pipe).__call__)

    # --- what a subclass says -------------------------------------------------------------------------
    def latent_frames(self, call: dict[str, Any]) -> int:
        """The latent frames the call will sample (from its bound arguments)."""
        raise NotImplementedError

    def io_axes(self, model: Any, hidden_states: torch.Tensor, frames: int) -> dict[str, int]:
        """``sharded_io``'s global axis lengths for one transformer call on a shard of ``frames`` frames."""
        raise NotImplementedError

    def decode_parts(self, frames: int) -> list[tuple[Any, str, Callable[..., Any]]]:
        """(object, method name, replacement) for the decode of a ``frames``-frame video, for one call."""
        return []

    def gathered_decode(self, frames: int) -> tuple[Any, str, Callable[..., Any]]:
        """``vae.decode`` on the latents gathered first (one all_gather): a VAE causal in time (Wan's,
        HunyuanVideo's) needs every earlier frame, so every rank decodes the whole video."""
        vae, decode = self.pipe.vae, self.pipe.vae.decode

        def gathered(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return decode(self.unshard(z, frames), *args, **kwargs)

        return (vae, "decode", gathered)

    # --- one call -------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The pipeline's ``__call__`` with its arguments, on this rank's frames; the full video on every rank."""
        bound = self._signature.bind(self.pipe, *args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop(next(iter(self._signature.parameters)))
        call.update(call.pop("kwargs", {}) or {})
        frames, do_cfg = self.check_call(call)
        shared = self.draws_unseeded(call)
        with self.intercepted(frames, do_cfg and self.cfg_group is not None, share_noise=shared):
            out = type(self.pipe).__call__(self.pipe, *args, **kwargs)
        if call.get("output_type") in ("latent", "latents"):     # the loop's shard, gathered once
            if isinstance(out, tuple):
                return (self.unshard(out[0], frames), *out[1:])
            out.frames = self.unshard(out.frames, frames)
        return out

    def check_call(self, call: dict[str, Any]) -> tuple[int, bool]:
        """Every entry check of a call, in one place, before the pipeline runs: a frame count below the DSP
        size, a CFG group without guidance (each raised on every rank before any collective), then the
        arguments alike on every rank (``agree_call``). Returns (latent frames, do_cfg)."""
        frames = self.latent_frames(call)
        n = group_size(self.dsp_group)
        if frames < n:
            raise ValueError(f"{type(self).__name__}: {self.frames_name}={frames} is smaller than the DSP size "
                             f"{n}; expected {self.frames_name} >= {n}{self.frames_hint(n)}")
        do_cfg, why_not, expected = self.cfg_enabled(call)
        if self.cfg_group is not None and not do_cfg:
            raise ValueError(f"{type(self).__name__}: {why_not} turns classifier-free guidance off, but the CFG "
                             f"group has 2 ranks; expected {expected} or cfg_group=None")
        self.agree_call({k: v for k, v in call.items() if k != "callback_on_step_end"})
        return frames, do_cfg

    def cfg_enabled(self, call: dict[str, Any]) -> tuple[bool, str, str]:
        """(whether the call runs classifier-free guidance, the arguments that turn it off, what turns it on):
        ``guidance_scale > 1`` (Latte, Wan); a pipeline that decides otherwise says so."""
        guidance_scale = call.get("guidance_scale", 1.0)
        return guidance_scale > 1.0, f"guidance_scale={guidance_scale}", "guidance_scale > 1"

    def draws_unseeded(self, call: dict[str, Any]) -> bool:
        """Whether the call draws noise from each process's own default generator (no generator and no latents
        given), so that rank 0's is sent to the others."""
        return call.get("generator") is None and call.get("latents") is None

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

    frames_name = "frames"

    def frames_hint(self, n: int) -> str:
        return ""

    @contextlib.contextmanager
    def intercepted(self, frames: int, cfg_parallel: bool, share_noise: bool = False) -> Iterator[None]:
        """The pipeline's parts replaced for one call, put back after it (also on an error). ``share_noise``:
        no generator and no latents were given, so rank 0's noise is sent to its peers before the split."""
        pipe = self.pipe
        prepare = pipe.prepare_latents

        def sharded_latents(*args: Any, **kwargs: Any) -> torch.Tensor:
            full = prepare(*args, **kwargs)
            return self.shard(self.share_noise(full) if share_noise else full)

        parts: list[tuple[Any, str, Any]] = [(pipe, "prepare_latents", sharded_latents)]
        parts += [(pipe, name, _ShardedModel(self, getattr(pipe, name), frames, cfg_parallel))
                  for name in self.transformer_names if getattr(pipe, name, None) is not None]
        parts += self.decode_parts(frames)
        saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in parts]
        try:
            for obj, name, value in parts:
                object.__setattr__(obj, name, value)
            yield
        finally:
            for obj, name, value in reversed(saved):
                if value is _MISSING:
                    object.__delattr__(obj, name)
                else:
                    object.__setattr__(obj, name, value)

    # --- data movement -------------------------------------------------------------------------------
    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, h, w]`` -> this rank's frames ``[B, C, T/N, h, w]`` (no communication)."""
        return split(full, 2, group=self.dsp_group)

    def unshard(self, shard: torch.Tensor, frames: int) -> torch.Tensor:
        """All frames back on every rank: one all_gather along dim 2."""
        return gather(shard.contiguous(), 2, group=self.dsp_group, global_len=frames)

    def cfg_exchange(self, mine: torch.Tensor) -> torch.Tensor:
        """``[2, ...]``: the unconditional half (CFG rank 0's) and the conditional one (rank 1's), one all_gather."""
        return gather(mine.unsqueeze(0).contiguous(), 0, group=self.cfg_group, global_len=2)


_MISSING = object()


class _ShardedModel:
    """The pipeline's transformer for one call: the DSP-parallel model under ``sharded_io`` on the frame shard;
    with CFG parallelism each CFG rank runs one half. Any other attribute is the model's own."""

    def __init__(self, sampler: FrameShardedSampler, model: Any, frames: int, cfg_parallel: bool) -> None:
        self.__dict__.update(_sampler=sampler, _model=model, _frames=frames, _cfg=cfg_parallel, _calls=0,
                             _pending=None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._cfg:
            return self._run(args, kwargs)
        s = self._sampler
        half = group_rank(s.cfg_group)                   # 0: unconditional, 1: conditional
        if s.cfg_batched:                                # one call on [uncond; cond]: this rank's half of each
            x = _hidden(args, kwargs)
            b = x.shape[0] // 2

            def pick(v: Any) -> Any:
                batched = isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 2 * b
                return v[half * b:(half + 1) * b] if batched else v

            out = self._run(tuple(map(pick, args)), {k: pick(v) for k, v in kwargs.items()})
            return _with_sample(out, s.cfg_exchange(_sample(out)).flatten(0, 1))
        # a cond call, then an uncond call (WanPipeline): the cond rank runs the first, the uncond rank the
        # second; the tensor returned by the first call is filled by the exchange in the second
        cond, self.__dict__["_calls"] = self._calls % 2 == 0, self._calls + 1
        if cond:
            if half == 1:
                out = self._run(args, kwargs)
                self.__dict__["_pending"] = _sample(out)
                return out
            x = _hidden(args, kwargs)
            shape = (x.shape[0], self._model.config.out_channels, *x.shape[2:])
            self.__dict__["_pending"] = torch.empty(shape, dtype=x.dtype, device=x.device)
            return _with_sample(kwargs.get("return_dict", True), self._pending)
        out = self._run(args, kwargs) if half == 0 else None
        both = s.cfg_exchange(_sample(out) if half == 0 else self._pending)
        if half == 0:
            self._pending.copy_(both[1])
            return out
        return _with_sample(kwargs.get("return_dict", True), both[0])

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from dsp_plugin.plan import sharded_io

        axes = self._sampler.io_axes(self._model, _hidden(args, kwargs), self._frames)
        with sharded_io(**axes):
            return self._model(*args, **kwargs)


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _sample(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _with_sample(like: Any, sample: torch.Tensor) -> Any:
    """``like``'s output structure (a tuple, a ``Transformer2DModelOutput``, or return_dict's value) around
    ``sample``."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    if isinstance(like, tuple):
        return (sample, *like[1:])
    if like is False:
        return (sample,)
    return Transformer2DModelOutput(sample=sample)


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
