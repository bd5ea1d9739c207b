"""One training step of the real-size model on fake tensors, as rank 0 of a fake world: memory, traffic, FLOPs.

    result = dry_run(Setup(model="wan2.1-14b", frames=81, height=720, width=1280, dsp=8, zero=3,
                           recompute="full"))

The model is built from its published config under ``FakeTensorMode`` (no memory is
allocated), made DSP-parallel by ``dsp_plugin.parallelize`` (its built-in plan) on the DSP
group of a ``fake`` process group, and runs forward and backward in bf16 once, inside
``CommAccounting`` (the collectives the plan issues, counted at the dispatcher, with their
bytes and groups), ``MemoryTracker`` (the live bytes of activations and temporaries, their
peak and the module holding it) and torch's ``FlopCounterMode``. Each parameter gradient is
dropped as soon as autograd has it, as ZeRO and Megatron's DDP hand it to their buffers: the
framework's own gradient storage, parameters and optimizer states come from ``state`` (DeepSpeed)
or from Megatron's own buffers (``megatron_family``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from dsp_plugin.bench.params import H100, Hardware
from dsp_plugin.dryrun.estimate import StepEstimate, estimate
from dsp_plugin.dryrun.models import Geometry, ModelSpec, load_spec
from dsp_plugin.dryrun.state import Collective, FrameworkState

__all__ = ["DryRun", "Setup", "dry_run"]

RECOMPUTE = ("off", "full")


@dataclass(frozen=True)
class Setup:
    """What a user states about the run (``None``: the model's default geometry and text length)."""

    model: str
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    text_tokens: int | None = None
    batch: int = 1
    dsp: int = 1
    tp: int = 1
    dp: int = 1
    zero: int = 2
    recompute: str = "off"
    distributed_optimizer: bool = True   # Megatron models: --use-distributed-optimizer
    dtype: str = "bf16"

    def resolve(self) -> tuple[ModelSpec, Geometry]:
        spec = load_spec(self.model)
        geometry = Geometry(self.frames or spec.frames, self.height or spec.height, self.width or spec.width,
                            spec.text_tokens if self.text_tokens is None else self.text_tokens, self.batch)
        geometry.latent(spec)  # refuses a size the VAE or the patching cannot take, naming it
        for name in ("batch", "dsp", "tp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: expected a positive integer")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute {self.recompute!r}: expected one of {RECOMPUTE}")
        if spec.family == "diffusers" and self.tp != 1:
            raise ValueError(f"--tp {self.tp}: {spec.name} is a diffusers model, which has no tensor-parallel "
                             f"layers; expected --tp 1 (the Megatron models take --tp)")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"--dtype {self.dtype!r}: expected 'bf16' or 'fp32'")
        return spec, geometry

    @property
    def world(self) -> int:
        return self.tp * self.dsp * self.dp


@dataclass
class DryRun:
    """Per GPU (rank 0: the most tokens), one step."""

    setup: Setup
    geometry: str
    tokens: int
    parameters: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    step_transient_bytes: int
    saved_bytes: int
    peak_module: str
    peak_phase: str
    flops: float
    collectives: list[Collective]
    estimate: StepEstimate
    framework: str
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Resident state plus the larger of the step's two peaks: backward (activations, buffers) or optimizer."""
        static = self.params_bytes + self.grads_bytes + self.optimizer_bytes
        return static + max(self.activations_bytes + self.buffers_bytes, self.step_transient_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"setup": asdict(self.setup), "geometry": self.geometry, "tokens": self.tokens,
                "parameters": self.parameters, "params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
                "buffers_bytes": self.buffers_bytes, "step_transient_bytes": self.step_transient_bytes,
                "peak_bytes": self.peak_bytes, "saved_activation_bytes": self.saved_bytes,
                "peak_module": self.peak_module, "peak_phase": self.peak_phase, "flops": self.flops,
                "framework": self.framework,
                "collectives": [asdict(c) for c in self.collectives],
                "estimate_s": {**asdict(self.estimate), "step_s": self.estimate.step_s},
                "dry_run_seconds": self.seconds, "notes": self.notes}


def pattern(module: str, phase: str = "forward") -> str:
    """``WanTransformer3DModel.blocks.3.attn1`` -> ``blocks.*.attn1`` (one row per kind of block).

    In backward only the block is named (``blocks.*``): torch's ``ModTracker`` knows which block's
    backward runs, not reliably which of its submodules'.
    """
    parts = ["*" if p.isdigit() else p for p in module.split(".")[1:]]
    if parts[:1] == ["module"]:  # a framework's wrapper (Megatron's DDP) around the model
        parts = parts[1:]
    if phase == "backward" and "*" in parts:
        parts = parts[:parts.index("*") + 1]
    return ".".join(parts) or "(model)"


def module_name(module: str) -> str:
    """``WanTransformer3DModel.blocks.39`` -> ``blocks.39`` (a framework wrapper's ``module.`` dropped too)."""
    name = module.partition(".")[2]
    return name.removeprefix("module.") or "(model)"


def group_names(topology: Any) -> dict[tuple[int, ...], str]:
    names = {"tp": "tp", "dsp": "dsp", "dp": "dp", "dp_dsp": "dp x dsp", "pp": "pp", "model_parallel": "tp x pp"}
    out: dict[tuple[int, ...], list[str]] = {}
    for axis, rank_lists in topology.layout.items():
        for ranks in rank_lists:
            out.setdefault(tuple(ranks), []).append(names.get(axis, axis))
    return {ranks: " = ".join(axes) for ranks, axes in out.items()}  # dsp = dp x dsp when DP is 1


def by_block(records: list[Any], sites: list[tuple[str, str]], groups: dict[tuple[int, ...], str]) -> list[Collective]:
    """The recorded collectives, summed per (block pattern, op, phase, group)."""
    if len(sites) != len(records):  # cannot pair them: one row per op and group
        sites = [("", r.phase) for r in records]
    rows: dict[tuple[str, str, str, str, int, str], list[int]] = {}
    for r, (module, _) in zip(records, sites):
        group = groups.get(tuple(r.group_ranks), f"{r.group_size} ranks")
        # outside every module: the framework's gradient reduction (Megatron's finalize_model_grads)
        framework = not module and r.op != "all_to_all"
        phase = "after backward" if framework and r.phase == "forward" else r.phase
        where = "gradients (the framework's reduction)" if framework else pattern(module, r.phase) if module else ""
        key = (where, r.op, phase, group, r.group_size, "data parallel" if framework else "sequence")
        row = rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += r.bytes_sent
    return [Collective(op, phase, group, size, count, sent, where, kind=kind)
            for (where, op, phase, group, size, kind), (count, sent) in rows.items()]


def dry_run(setup: Setup, hw: Hardware = H100) -> DryRun:
    """Run ``setup`` once on fake tensors (see the module docstring); the step time is priced on ``hw``."""
    spec, geometry = setup.resolve()
    if spec.family == "megatron":
        from dsp_plugin.dryrun.megatron_family import dry_run_megatron

        return dry_run_megatron(setup, spec, geometry, hw)
    return _dry_run_diffusers(setup, spec, geometry, hw)


def _dry_run_diffusers(setup: Setup, spec: ModelSpec, geometry: Geometry, hw: Hardware) -> DryRun:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.dryrun import diffusers_family
    from dsp_plugin.dryrun.memory import MemoryTracker
    from dsp_plugin.dryrun.state import deepspeed_state
    from dsp_plugin.dryrun.world import fake_world
    from dsp_plugin.plan import parallelize

    start = time.perf_counter()
    dtype = torch.bfloat16 if setup.dtype == "bf16" else torch.float32
    with fake_world(setup.world, dsp=setup.dsp) as topology, FakeTensorMode():
        model = diffusers_family.build(spec, dtype=dtype, recompute=setup.recompute == "full")
        trainable = [p for p in model.parameters() if p.requires_grad]
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        if setup.dsp > 1:
            parallelize(model)  # the built-in plan, on the topology's DSP group
        for p in trainable:  # ZeRO / DDP take each gradient into their own buffers as it is produced
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        tracker = MemoryTracker(exclude=[*model.parameters(), *model.buffers()], model=model)
        with CommAccounting() as acct, tracker:
            loss = diffusers_family.loss(model, spec, geometry, dtype=dtype)
            saved = acct.saved_activation_bytes  # at the end of the forward
            loss.backward()
            del loss
        collectives = by_block(acct.records, tracker.collective_sites, group_names(topology))
    state: FrameworkState = deepspeed_state([p.numel() for p in trainable], zero=setup.zero,
                                            group_size=setup.dp * setup.dsp, largest_module=largest,
                                            recompute=setup.recompute == "full")
    collectives += state.collectives
    tf, th, tw = geometry.tokens(spec)
    total_flops = float(tracker.flops)
    return DryRun(setup=setup, geometry=geometry.describe(spec), tokens=tf * th * tw * geometry.batch,
                  parameters=sum(p.numel() for p in trainable), params_bytes=state.params,
                  grads_bytes=state.grads, optimizer_bytes=state.optimizer, activations_bytes=tracker.peak,
                  buffers_bytes=state.buffers, step_transient_bytes=state.step_transient, saved_bytes=saved,
                  peak_module=module_name(tracker.peak_module),
                  peak_phase=tracker.peak_phase, flops=total_flops,
                  collectives=collectives,
                  estimate=estimate(total_flops, collectives, tp=setup.tp, world=setup.world, hw=hw),
                  framework=f"DeepSpeed {state.describe}", seconds=time.perf_counter() - start)


def sweep(setup: Setup, dsp_sizes: list[int], hw: Hardware = H100) -> list[DryRun]:
    """``dry_run`` at each DSP size (DP unchanged)."""
    return [dry_run(replace(setup, dsp=n), hw) for n in dsp_sizes]
