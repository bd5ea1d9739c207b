"""The dry run's per-GPU table, its JSON, the sweep table and the sweep plot."""

from __future__ import annotations

from pathlib import Path

from dsp_plugin.dryrun.result import DryRun

__all__ = ["render", "render_sweep", "plot_sweep"]

GIB = 2**30
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _unit(largest: float) -> tuple[str, int]:
    """GiB for a real model, MiB or KiB for the tiny ones the checks run."""
    return next(((name, size) for name, size in _UNITS if largest >= size), _UNITS[-1])


def render(r: DryRun, *, gpu_gib: float, hardware: str) -> str:
    s = r.setup
    fits = r.peak_bytes <= gpu_gib * GIB
    unit, size = _unit(r.peak_bytes)

    def _gib(n: float) -> str:
        return f"{n / size:,.2f}"

    lines = [
        f"dsp_plugin dry run: {s.model}, "
        f"{f'{r.parameters / 1e9:.2f}B' if r.parameters >= 1e8 else f'{r.parameters:,}'} parameters, {s.dtype}, "
        f"recompute {s.recompute}",
        r.geometry,
        f"world {s.world} = tp {s.tp} x dsp {s.dsp} x dp {s.dp}; {r.framework}",
        f"per GPU: rank 0, which holds the largest shard of the {r.tokens:,} tokens of its DSP group's batch "
        "(a length L on N ranks is cut like torch.tensor_split: the first L mod N ranks hold one more)",
        "",
        f"| memory per GPU | {unit} |", "|---|---|",
        f"| parameters | {_gib(r.params_bytes)} |",
        f"| gradients | {_gib(r.grads_bytes)} |",
        f"| optimizer states | {_gib(r.optimizer_bytes)} |",
        f"| activations (peak, at {r.peak_module}, {r.peak_phase}) | {_gib(r.activations_bytes)} |",
        f"| communication buffers | {_gib(r.buffers_bytes)} |",
        f"| **peak** | **{_gib(r.peak_bytes)}**: {'fits' if fits else 'DOES NOT FIT'} in {gpu_gib:g} GiB |",
        "",
        f"Saved for backward at the end of the forward: {_gib(r.saved_bytes)} {unit}. The optimizer step adds "
        f"{_gib(r.step_transient_bytes)} {unit} (an fp32 copy of this rank's gradients), "
        f"{'above' if r.step_transient_bytes > r.activations_bytes + r.buffers_bytes else 'below'} the backward's "
        "activations and buffers.",
        "",
        f"| collectives of one step | op | phase | group | calls | {unit} sent |", "|---|---|---|---|---|---|",
    ]
    for c in r.collectives:
        where = f"{c.where}" + (" *(modelled)*" if c.modelled else "")
        lines.append(f"| {where} | {c.op} | {c.phase} | {c.group} ({c.group_size}) | {c.count} | "
                     f"{_gib(c.bytes_sent)} |")
    e = r.estimate
    lines += ["",
              f"FLOPs of this rank's step (forward, backward, recompute): {r.flops / 1e15:,.2f} PFLOP.",
              f"Estimated step on {hardware}: {e.step_s:,.2f} s = compute {e.compute_s:,.2f} + sequence collectives "
              f"{e.sequence_s:,.3f} + their copies {e.copies_s:,.3f} + data parallel {e.data_parallel_s:,.3f} "
              "(nothing overlapped; dsp_plugin/bench/scale_model.py).",
              f"(dry run took {r.seconds:,.1f} s)"]
    return "\n".join(lines) + "\n"


def render_sweep(runs: list[DryRun], *, gpu_gib: float) -> str:
    unit, size = _unit(max(r.peak_bytes for r in runs))

    def _gib(n: float) -> str:
        return f"{n / size:,.2f}"

    lines = [f"| N (dsp) | GPUs | tokens / N | params | grads | optimizer | activations | buffers | peak {unit} | fits "
             f"{gpu_gib:g} GiB | step s | peak at |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.setup
        lines.append(f"| {s.dsp} | {s.world} | {-(-r.tokens // s.dsp):,} | {_gib(r.params_bytes)} | "
                     f"{_gib(r.grads_bytes)} | "
                     f"{_gib(r.optimizer_bytes)} | {_gib(r.activations_bytes)} | {_gib(r.buffers_bytes)} | "
                     f"**{_gib(r.peak_bytes)}** | {'yes' if r.peak_bytes <= gpu_gib * GIB else 'no'} | "
                     f"{r.estimate.step_s:,.2f} | {r.peak_module} ({r.peak_phase}) |")
    return "\n".join(lines) + "\n"


def plot_sweep(runs: list[DryRun], path: Path, *, gpu_gib: float, title: str) -> Path:
    """Memory per GPU (stacked) and the estimated step time against N, with the GPU's memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.setup.dsp for r in runs]
    xs = list(range(len(ns)))
    parts = [("parameters", [r.params_bytes for r in runs]), ("gradients", [r.grads_bytes for r in runs]),
             ("optimizer", [r.optimizer_bytes for r in runs]),
             ("activations", [r.activations_bytes for r in runs]), ("buffers", [r.buffers_bytes for r in runs])]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(runs)
    for label, values in parts:
        gib = [v / GIB for v in values]
        ax.bar(xs, gib, bottom=bottom, label=label, width=0.6)
        bottom = [b + g for b, g in zip(bottom, gib)]
    ax.axhline(gpu_gib, color="black", linestyle="--", linewidth=1, label=f"GPU memory {gpu_gib:g} GiB")
    ax.set_xticks(xs, [str(n) for n in ns])
    ax.set_xlabel("DSP size N")
    ax.set_ylabel("memory per GPU, GiB")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.estimate.step_s for r in runs], color="crimson", marker="o", label="estimated step s")
    ax2.set_ylabel("estimated step, s")
    ax2.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(handles, labels, fontsize=7, loc="upper right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
