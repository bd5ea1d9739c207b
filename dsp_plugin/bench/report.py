"""Turn the ranks' raw numbers into the summary, the markdown table, the JSON file and the plots.

Column meanings are documented in ``docs/benchmarks.md``. Per-device numbers
take the maximum over ranks (the slowest or busiest device is what a step
waits for); the step time is, per step, the slowest rank, then the median.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dsp_plugin.bench.config import METHODS, BenchConfig

#: paper Table 3, per layer (two 1D blocks) and device, as multiples of M: f(N)
TABLE3 = {
    "dsp": ("2M/N", lambda n: 2 / n),
    "ulysses": ("4M/N", lambda n: 4 / n),
    "megatron_sp": ("8M", lambda n: 8.0),
    "ring": ("2M", lambda n: 2.0),
}


def exact_per_layer(method: str, n: int, depth: int) -> tuple[float, float]:
    """Forward and backward bytes per layer of THIS implementation, in multiples of M.

    The paper rounds (N-1)/N to 1; DSP issues 2L-1 switches for L layers (the
    first block needs none); ring attention's backward also returns dK, dV home.
    """
    share = (n - 1) / n
    if method == "dsp":
        f = (2 * depth - 1) / depth * share / n
        return f, f
    if method == "ulysses":
        return 4 * share / n, 4 * share / n
    if method == "megatron_sp":
        return 8 * share, 8 * share
    return 2 * share, (2 * (n - 1) + 2 * n) / n


def summarize(per_rank: list[dict[str, Any]], cfg: BenchConfig, n: int) -> dict[str, Any]:
    """One row per method plus the micro-benchmark (see the module docstring)."""
    m_bytes = cfg.activation_bytes
    rows: dict[str, Any] = {}
    for method in METHODS:
        results = [r["methods"].get(method) for r in per_rank]
        if results[0] is None:
            continue
        if "error" in results[0]:
            rows[method] = {"error": results[0]["error"]}
            continue
        label, factor = TABLE3[method]
        analytic = factor(n) * m_bytes
        exact_f, exact_b = exact_per_layer(method, n, cfg.depth)
        fwd = max(r["fwd_bytes_per_layer"] for r in results)
        bwd = max(r["bwd_bytes_per_layer"] for r in results)
        step = statistics.median(max(ts) for ts in zip(*(r["step_times_s"] for r in results)))
        rows[method] = {
            "fwd_bytes_per_layer": fwd, "bwd_bytes_per_layer": bwd,
            "table3": label, "table3_bytes": analytic,
            "fwd_over_table3": fwd / analytic, "bwd_over_table3": bwd / analytic,
            "fwd_over_exact": fwd / (exact_f * m_bytes), "bwd_over_exact": bwd / (exact_b * m_bytes),
            "fwd_ops": results[0]["fwd_ops"], "bwd_ops": results[0]["bwd_ops"],
            "saved_activation_bytes": max(r["saved_activation_bytes"] for r in results),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "median_step_s": step,
            "step_times_s_per_rank": [r["step_times_s"] for r in results],
            "max_abs_err_vs_single": max(r["max_abs_err_vs_single"] for r in results),
        }
    dsp_step = rows.get("dsp", {}).get("median_step_s")
    for row in rows.values():
        if "median_step_s" in row and dsp_step:
            row["step_over_dsp"] = row["median_step_s"] / dsp_step
    micro = {
        "bytes_per_rank": per_rank[0]["micro"]["bytes_per_rank"],
        "switch_s": max(r["micro"]["switch"] for r in per_rank),
        "all_to_all_single_s": max(r["micro"]["all_to_all_single"] for r in per_rank),
    }
    micro["switch_over_bare"] = micro["switch_s"] / micro["all_to_all_single_s"]
    return {"nproc": n, "config": cfg.__dict__, "activation_bytes_M": m_bytes, "methods": rows, "micro": micro}


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def markdown(summary: dict[str, Any]) -> str:
    cfg, n = summary["config"], summary["nproc"]
    lines = [
        f"N={n} gloo ranks on CPU; STDiT depth={cfg['depth']} hidden={cfg['hidden']} heads={cfg['heads']}, "
        f"input B={cfg['batch']} T={cfg['frames']} S={(cfg['height'] // 2) * (cfg['width'] // 2)}; "
        f"M = {_kib(summary['activation_bytes_M'])} KiB; {cfg['steps']} timed steps after {cfg['warmup']} warm-up.",
        "",
        "| method | fwd KiB/layer | bwd KiB/layer | Table 3 | fwd / T3 | bwd / T3 | fwd / exact | bwd / exact "
        "| saved act. KiB/rank | peak RSS MiB | median step ms | step / DSP | max abs err vs 1-proc |",
        "|---" * 13 + "|",
    ]
    for method, r in summary["methods"].items():
        if "error" in r:
            lines.append(f"| {method} | {r['error']} |" + " |" * 11)
            continue
        lines.append(
            f"| {method} | {_kib(r['fwd_bytes_per_layer'])} | {_kib(r['bwd_bytes_per_layer'])} | {r['table3']} "
            f"| {r['fwd_over_table3']:.3f} | {r['bwd_over_table3']:.3f} | {r['fwd_over_exact']:.3f} "
            f"| {r['bwd_over_exact']:.3f} | {_kib(r['saved_activation_bytes'])} "
            f"| {r['peak_rss_bytes'] / 2**20:.0f} | {1e3 * r['median_step_s']:.1f} "
            f"| {r.get('step_over_dsp', float('nan')):.2f} | {r['max_abs_err_vs_single']:.1e} |")
    micro = summary["micro"]
    lines += ["", f"Micro-benchmark ({_kib(micro['bytes_per_rank'])} KiB per rank): one dynamic_switch "
              f"{1e3 * micro['switch_s']:.3f} ms, bare all_to_all_single {1e3 * micro['all_to_all_single_s']:.3f} ms "
              f"(switch / bare = {micro['switch_over_bare']:.2f})."]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bytes per layer (measured and Table 3) and median step time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {m: r for m, r in summary["methods"].items() if "error" not in r}
    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    xs = range(len(names))
    for i, (key, label) in enumerate((("fwd_bytes_per_layer", "measured fwd"),
                                      ("bwd_bytes_per_layer", "measured bwd"), ("table3_bytes", "Table 3"))):
        ax1.bar([x + (i - 1) * width for x in xs], [rows[m][key] / 1024 for m in names], width, label=label)
    ax1.set_xticks(list(xs), names)
    ax1.set_yscale("log")
    ax1.set_ylabel("KiB per layer per device")
    ax1.set_title(f"Communication, N={summary['nproc']}")
    ax1.legend()
    ax2.bar(names, [1e3 * rows[m]["median_step_s"] for m in names], color="tab:gray")
    ax2.set_ylabel("median step ms (CPU, gloo)")
    ax2.set_title("Step time (fwd + bwd)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(path: Path) -> None:
    """Predicted end-to-end step time on 128 H100 per method and Table 5 setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsp_plugin.bench.scale_report import e2e_rows

    rows = e2e_rows()
    settings = list(dict.fromkeys((r["model"], r["tokens"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.2
    for i, method in enumerate(METHODS):
        vals = []
        for s in settings:
            pred = next(r["pred"] for r in rows if (r["model"], r["tokens"]) == s and r["method"] == method)
            vals.append(pred.step_s if pred is not None and pred.feasible else 0.0)
        ax.bar([x + (i - 1.5) * width for x in range(len(settings))], vals, width, label=method)
    ax.set_xticks(range(len(settings)), [f"{m}\n{t}" for m, t in settings])
    ax.set_yscale("log")
    ax.set_ylabel("predicted step s (no bar: not run in the paper)")
    ax.set_title("Scale model: 128 H100, paper Table 5 settings")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
