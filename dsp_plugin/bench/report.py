"""Turn the ranks' raw numbers into the summary, the markdown tables, the JSON file and the plots.

Column meanings are documented in ``docs/benchmarks.md``. Per-device numbers
take the maximum over ranks (the slowest or busiest device is what a step
waits for). Step times: per round, the slowest rank; a method's time ratio to
DSP is taken round by round (the two ran seconds apart), then summarised by
its median, interquartile range and extremes.
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
    "ulysses_paper": ("4M/N", lambda n: 4 / n),
    "megatron_sp": ("8M", lambda n: 8.0),
    "ring": ("2M", lambda n: 2.0),
}


def exact_per_layer(method: str, n: int, depth: int) -> tuple[float, float]:
    """Forward and backward bytes per layer of THIS implementation, in multiples of M, without text.

    The paper rounds (N-1)/N to 1; DSP issues 2L-1 switches for L layers (the
    first block needs none); ring attention's backward also returns dK, dV home;
    ``ulysses_paper`` all-to-alls q, k, v, o in both blocks (its cross-attention
    terms are added by ``exact_bytes``).
    """
    share = (n - 1) / n
    if method == "dsp":
        f = (2 * depth - 1) / depth * share / n
        return f, f
    if method == "ulysses":
        return 4 * share / n, 4 * share / n
    if method == "ulysses_paper":
        return 8 * share / n, 8 * share / n
    if method == "megatron_sp":
        return 8 * share, 8 * share
    return 2 * share, (2 * (n - 1) + 2 * n) / n


def exact_bytes(method: str, n: int, cfg: BenchConfig, *, checkpointing: bool) -> tuple[float, float]:
    """Forward and backward bytes per layer and device; the backward includes the recompute if checkpointed.

    DSP's recompute sends nothing: the plan runtime keeps each switch's output through the model's own
    checkpointing and the recompute takes it (``dsp_plugin.plan.recompute``).
    """
    f, b = (x * cfg.activation_bytes for x in exact_per_layer(method, n, cfg.depth))
    if method == "ulysses_paper" and cfg.text_dim:
        # both blocks' cross-attention: q and o (activation-sized), the text's k and v
        cross = 2 * (2 * cfg.activation_bytes / n + 2 * cfg.text_bytes) * (n - 1) / n
        f, b = f + cross, b + cross
    return f, (b + f if checkpointing and method != "dsp" else b)


def quantiles(xs: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of per-round figures (times or same-round ratios); shared by the benches."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0], "max": xs[-1]}


def summarize(per_rank: list[dict[str, Any]], cfg: BenchConfig, n: int) -> dict[str, Any]:
    """One row per label (method, checkpointing) plus the micro-benchmark (see the module docstring)."""
    m_bytes = cfg.activation_bytes
    rows: dict[str, Any] = {}
    rounds: dict[str, list[float]] = {}
    cpu_rounds: dict[str, list[float]] = {}
    for name, first in per_rank[0]["methods"].items():
        results = [r["methods"][name] for r in per_rank]
        if "error" in first:
            rows[name] = dict(first)
            continue
        method, ckpt = first["method"], first["checkpointing"]
        exact_f, exact_b = exact_bytes(method, n, cfg, checkpointing=ckpt)
        fwd = max(r["fwd_bytes_per_layer"] for r in results)
        bwd = max(r["bwd_bytes_per_layer"] for r in results)
        rounds[name] = [max(ts) for ts in zip(*(r["step_times_s"] for r in results))]
        cpu_rounds[name] = [max(ts) for ts in zip(*(r["cpu_times_s"] for r in results))]
        rows[name] = {
            "method": method, "checkpointing": ckpt,
            "fwd_bytes_per_layer": fwd, "bwd_bytes_per_layer": bwd,
            "table3": TABLE3[method][0], "table3_bytes": TABLE3[method][1](n) * m_bytes,
            "fwd_over_exact": fwd / exact_f, "bwd_over_exact": bwd / exact_b,
            "fwd_ops": first["fwd_ops"], "bwd_ops": first["bwd_ops"],
            "saved_activation_bytes": max(r["saved_activation_bytes"] for r in results),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "step_s": quantiles(rounds[name]), "cpu_s": quantiles(cpu_rounds[name]),
            "step_times_s_per_rank": [r["step_times_s"] for r in results],
            "max_abs_err_vs_single": max(r["max_abs_err_vs_single"] for r in results),
        }
    for name, row in rows.items():
        if name not in rounds:
            continue
        dsp = "dsp+ckpt" if row["checkpointing"] else "dsp"
        if dsp in rounds:
            row["over_dsp"] = quantiles([a / b for a, b in zip(rounds[name], rounds[dsp])])
            row["cpu_over_dsp"] = quantiles([a / b for a, b in zip(cpu_rounds[name], cpu_rounds[dsp])])
        if row["checkpointing"] and row["method"] in rounds:
            row["over_no_ckpt"] = quantiles([a / b for a, b in zip(rounds[name], rounds[row["method"]])])
    micro = {
        "bytes_per_rank": per_rank[0]["micro"]["bytes_per_rank"],
        "switch_s": max(r["micro"]["switch"] for r in per_rank),
        "all_to_all_single_s": max(r["micro"]["all_to_all_single"] for r in per_rank),
    }
    micro["switch_over_bare"] = micro["switch_s"] / micro["all_to_all_single_s"]
    return {"nproc": n, "config": cfg.__dict__, "activation_bytes_M": m_bytes, "methods": rows, "micro": micro}


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def _spread(q: dict[str, float] | None) -> str:
    if q is None:
        return "-"
    return f"{q['median']:.2f} [{q['p25']:.2f}-{q['p75']:.2f}] ({q['min']:.2f}-{q['max']:.2f})"


def markdown(summary: dict[str, Any]) -> str:
    cfg, n = summary["config"], summary["nproc"]
    rows = summary["methods"]
    spatial = (cfg["height"] // 2) * (cfg["width"] // 2)
    per_rank = summary["activation_bytes_M"] / n
    lines = [
        f"N={n} gloo ranks on CPU; STDiT with adaLN and cross-attention, depth={cfg['depth']} "
        f"hidden={cfg['hidden']} heads={cfg['heads']}, input B={cfg['batch']} T={cfg['frames']} S={spatial} "
        f"text {cfg['text_len']}x{cfg['text_dim']}; M = {summary['activation_bytes_M'] / 2**20:.2f} MiB "
        f"(one rank's shard {per_rank / 2**20:.2f} MiB); {cfg['steps']} timed rounds after {cfg['warmup']} warm-up.",
        "",
        "Bytes per layer and device (KiB), measured by `CommAccounting`; `with recompute` is the backward "
        "under activation checkpointing (recomputed forward included).",
        "",
        "| method | fwd | bwd | bwd with recompute | step total, plain | step total, recompute | Table 3 "
        "| fwd calls/layer | measured / exact (all columns) | saved act. MiB/rank (plain) |",
        "|---" * 10 + "|",
    ]
    for method in METHODS:
        plain, ck = rows.get(method), rows.get(method + "+ckpt")
        if plain is None or "error" in plain:
            if plain is not None:
                lines.append(f"| {method} | {plain['error']} |" + " |" * 8)
            continue
        exact_ok = [plain["fwd_over_exact"], plain["bwd_over_exact"]]
        ck_bwd = "-"
        ck_total = "-"
        if ck is not None and "error" not in ck:
            exact_ok += [ck["fwd_over_exact"], ck["bwd_over_exact"]]
            ck_bwd = _kib(ck["bwd_bytes_per_layer"])
            ck_total = _kib(ck["fwd_bytes_per_layer"] + ck["bwd_bytes_per_layer"])
        calls = sum(plain["fwd_ops"].values()) / cfg["depth"]
        lines.append(
            f"| {method} | {_kib(plain['fwd_bytes_per_layer'])} | {_kib(plain['bwd_bytes_per_layer'])} | {ck_bwd} "
            f"| {_kib(plain['fwd_bytes_per_layer'] + plain['bwd_bytes_per_layer'])} | {ck_total} | {plain['table3']} "
            f"| {calls:g} | {min(exact_ok):.3f}-{max(exact_ok):.3f} "
            f"| {plain['saved_activation_bytes'] / 2**20:,.1f} |")
    lines += ["", "Step time: median ms, and the time over DSP's in the same round as "
              "median [interquartile range] (min-max) over the rounds; wall time, then the ranks' CPU "
              "time (user + system: other jobs' time on the cores left out).", "",
              "| method | plain ms | plain / dsp | recompute ms | recompute / dsp+ckpt | recompute / plain "
              "| CPU: plain / dsp | CPU: recompute / dsp+ckpt | max abs err vs 1-proc |", "|---" * 9 + "|"]
    for method in METHODS:
        plain, ck = rows.get(method), rows.get(method + "+ckpt")
        if plain is None or "error" in plain:
            continue
        ck_ok = ck is not None and "error" not in ck
        lines.append(
            f"| {method} | {1e3 * plain['step_s']['median']:.0f} | {_spread(plain.get('over_dsp'))} "
            f"| {(f'{1e3 * ck['step_s']['median']:.0f}' if ck_ok else '-')} "
            f"| {_spread(ck.get('over_dsp') if ck_ok else None)} "
            f"| {_spread(ck.get('over_no_ckpt') if ck_ok else None)} "
            f"| {_spread(plain.get('cpu_over_dsp'))} | {_spread(ck.get('cpu_over_dsp') if ck_ok else None)} "
            f"| {max(plain['max_abs_err_vs_single'], ck['max_abs_err_vs_single'] if ck_ok else 0):.1e} |")
    micro = summary["micro"]
    lines += ["", f"Micro-benchmark ({micro['bytes_per_rank'] / 2**20:.2f} MiB per rank): one dynamic_switch "
              f"{1e3 * micro['switch_s']:.3f} ms, bare all_to_all_single {1e3 * micro['all_to_all_single_s']:.3f} ms "
              f"(switch / bare = {micro['switch_over_bare']:.2f})."]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bytes per layer per step (plain and recompute) and the CPU-time ratio to DSP with its spread, one PNG.

    CPU time, not wall time: on a shared machine its per-round ratios are several times tighter.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["methods"]
    names = [m for m in METHODS if m in rows and "error" not in rows[m]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.38
    for i, (suffix, title) in enumerate((("", "plain"), ("+ckpt", "recompute"))):
        vals = [(rows[m + suffix]["fwd_bytes_per_layer"] + rows[m + suffix]["bwd_bytes_per_layer"]) / 2**20
                if m + suffix in rows and "error" not in rows[m + suffix] else 0.0 for m in names]
        ax1.bar([x + (i - 0.5) * width for x in range(len(names))], vals, width, label=title)
        ratios = [rows[m + suffix].get("cpu_over_dsp") if m + suffix in rows else None for m in names]
        med = [q["median"] if q else 0.0 for q in ratios]
        err = [[q["median"] - q["p25"] if q else 0 for q in ratios],
               [q["p75"] - q["median"] if q else 0 for q in ratios]]
        ax2.bar([x + (i - 0.5) * width for x in range(len(names))], med, width, yerr=err, capsize=3, label=title)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_yscale("log")
    ax1.set_ylabel("MiB per layer per device (fwd + bwd)")
    ax1.set_title(f"Communication, N={summary['nproc']}")
    ax1.legend()
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.set_xticks(range(len(names)), names)
    ax2.set_ylabel("step CPU time / DSP's (median, IQR)")
    ax2.set_title("Step CPU time over DSP's, same round, CPU gloo")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(path: Path, hw: Any = None) -> None:
    """Predicted Table 5 step time over DSP's per method, and the factor ladder, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsp_plugin.bench import params
    from dsp_plugin.bench.scale_report import e2e_rows, ladder

    hw = hw or params.H100
    rows = e2e_rows(hw)
    labels = [f"{r['model']}\n{r['tokens']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    others = [m for m in METHODS if m != "dsp"]
    width = 0.2
    for i, m in enumerate(others):
        vals = [r["over_dsp"][m] or 0.0 for r in rows]
        ax1.bar([x + (i - 1.5) * width for x in range(len(rows))], vals, width, label=m)
    ax1.axhline(1.0, color="black", lw=0.8)
    lo, hi = params.PAPER_E2E_DSP_OVER_ULYSSES
    ax1.axhspan(1 + lo, 1 + hi, color="tab:blue", alpha=0.12, label="paper: DSP over Ulysses")
    ax1.set_xticks(range(len(rows)), labels)
    ax1.set_yscale("log")
    ax1.set_ylabel("predicted step time / DSP's (no bar: not run)")
    ax1.set_title("Scale model, 128 H100, Table 5 settings")
    ax1.legend(fontsize=8)
    steps = ladder(hw)
    keys = [(r["model"], r["tokens"]) for r in rows]
    for step in steps[:-1]:
        ax2.plot(range(len(keys)), [step["ratios"][k] for k in keys], marker="o", label=step["label"].split("(")[0])
    ax2.plot(range(len(keys)), [steps[-1]["ratios"][k] for k in keys], "k--", label="best-practice ulysses")
    ax2.axhspan(1 + lo, 1 + hi, color="tab:blue", alpha=0.12)
    ax2.set_xticks(range(len(keys)), labels)
    ax2.set_ylabel("ulysses_paper / dsp")
    ax2.set_title("Factor ladder")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
