"""What a dry run is asked (``Setup``) and what it answers (``DryRun``), and the collectives grouped by block.

Shared by both model families (``diffusers_family``, ``megatron_family``) and the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dsp_plugin.dryrun.estimate import StepEstimate
from dsp_plugin.dryrun.models import Geometry, ModelSpec, load_spec
from dsp_plugin.dryrun.state import Collective

__all__ = ["DryRun", "Setup", "by_block", "group_names", "module_name", "pattern"]

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
        for flag, value in (("--frames", self.frames), ("--height", self.height), ("--width", self.width),
                            ("--text-len", self.text_tokens), ("--batch", self.batch), ("--dsp", self.dsp),
                            ("--tp", self.tp), ("--dp", self.dp)):  # None: the model's default
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag} {value}: expected a positive integer")
        spec = load_spec(self.model)
        geometry = Geometry(*(spec_value if value is None else value for value, spec_value in
                              ((self.frames, spec.frames), (self.height, spec.height), (self.width, spec.width),
                               (self.text_tokens, spec.text_tokens))), self.batch)
        geometry.latent(spec)  # refuses a size the VAE or the patching cannot take, naming it
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
