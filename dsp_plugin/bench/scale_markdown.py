"""The scale model's tables as markdown: what ``python -m dsp_plugin.bench --scale-only`` prints."""

from __future__ import annotations

from dsp_plugin.bench import params
from dsp_plugin.bench.scale_model import METHODS, Prediction
from dsp_plugin.bench.scale_report import comparisons, e2e_rows, inference_rows, ladder, scaling_rows


def _cell(p: Prediction | None, sp: int | None = None) -> str:
    if p is None:
        return "not run"
    if not p.feasible:
        return p.reason.split(":")[0]
    return f"{p.step_s:.2f}" + (f" ({sp})" if sp is not None else "")


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def parameters_table(calibration_rows: list[tuple[str, str, str]]) -> list[str]:
    out = ["### Parameters (every other number and its source: `dsp_plugin/bench/params.py`)", "",
           "| quantity | value | measured or assumed |", "|---|---|---|"]
    out += [f"| {k} | {v} | {s} |" for k, v, s in calibration_rows]
    out += [f"| bytes per element | {params.BYTES_PER_ELEMENT} | harness fact: `--mixed_precision bf16` |",
            f"| activation checkpointing | {params.ACTIVATION_CHECKPOINTING} | harness fact: `--grad_checkpoint` |",
            f"| copies per all-to-all | {params.COPIES_PER_ALL_TO_ALL} | harness fact: list-based all-to-all; "
            "DSP's own pack + unpack |",
            "| linears per token per layer | 36 C^2 FLOPs | harness fact: STDiT block with cross-attention, one MLP |"]
    return out


def markdown(hw: params.Hardware = params.H100,
             calibration_rows: list[tuple[str, str, str]] | None = None) -> str:
    """Every scale-model table and the comparison with the paper."""
    out: list[str] = []
    if calibration_rows is not None:
        out += parameters_table(calibration_rows) + [""]
    rows = e2e_rows(hw)
    out += ["### End-to-end, 128 H100 (paper Table 5): predicted step s (SP size) and time over DSP", "",
            "`ulysses`: best practice (temporal block only). `ulysses_paper`, `megatron_sp`, `ring`: as the "
            "paper's harness ran them (OpenDiT `exp`): Ulysses around every attention, Megatron-SP "
            "all-gather/reduce-scatter around all three attentions with the MLP replicated, Ring in the "
            "spatial block over N x S keys. One sample per SP group, ZeRO-2 over DP.", "",
            "| model | tokens | " + " | ".join(METHODS) + " | ulysses_paper / dsp | ulysses / dsp "
            "| megatron_sp / dsp | ring / dsp | dsp comm+copies % | dsp TFLOPS/GPU |",
            "|---" * (len(METHODS) + 8) + "|"]
    for r in rows:
        d = r["preds"]["dsp"]
        cells = [_cell(r["preds"][m], (r["sizes"][m] or (None,))[0]) for m in METHODS]
        share = 100 * (d.comm_s + d.copy_s) / d.step_s
        out.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(cells) + " | "
                   + " | ".join(_ratio(r["over_dsp"][m]) for m in ("ulysses_paper", "ulysses", "megatron_sp", "ring"))
                   + f" | {share:.1f} | {d.flops_per_gpu / 1e12:.0f} |")
    steps = ladder(hw)
    keys = [(s.model, s.tokens) for s in params.E2E]
    out += ["", "### Factor ladder: ulysses_paper / dsp step time, adding one effect of the paper's harness a row",
            "", "| factors | " + " | ".join(f"{m} {t}" for m, t in keys) + " | range |",
            "|---" * (len(keys) + 2) + "|"]
    for step in steps:
        vals = [step["ratios"][k] for k in keys]
        out.append(f"| {step['label']} | " + " | ".join(f"{v:.2f}" for v in vals)
                   + f" | {min(vals):.2f}-{max(vals):.2f} |")
    lo, hi = params.PAPER_E2E_DSP_OVER_ULYSSES
    out.append(f"| paper (sec 5.1) | | | | | | | | | {1 + lo:.2f}-{1 + hi:.2f} |")
    for kind, title, what in (
            ("weak", "Weak scaling (Table 7)", "per-GPU throughput over the method's first point"),
            ("strong", "Strong scaling (Table 6)", "speedup over the method's first point")):
        out += ["", f"### {title}: {what}; last columns: time over DSP", "",
                "| model | tier | GPUs | batch | " + " | ".join(METHODS) + " | dsp step s | "
                + " | ".join(f"{m} / dsp" for m in METHODS[1:]) + " |",
                "|---" * (2 * len(METHODS) + 4) + "|"]
        for r in scaling_rows(kind, hw):
            effs = [f"{r[m + '_eff']:.2f}" if r[m + "_eff"] is not None else r[m].reason.split(":")[0]
                    for m in METHODS]
            rel = [_ratio(r[m].step_s / r["dsp"].step_s if r[m].feasible else None) for m in METHODS[1:]]
            out.append(f"| {r['model']} | {r['tier']} | {r['gpus']} | {r['batch']} | " + " | ".join(effs)
                       + f" | {r['dsp'].step_s:.2f} | " + " | ".join(rel) + " |")
    out += ["", "### Inference latency (Figure 8): one forward at the strong-scaling settings, seconds", "",
            "| model | tier | GPUs | " + " | ".join(METHODS) + " | "
            + " | ".join(f"{m} / dsp" for m in METHODS[1:]) + " |",
            "|---" * (2 * len(METHODS) + 2) + "|"]
    for r in inference_rows(hw):
        rel = [_ratio(r[m].step_s / r["dsp"].step_s if r[m].feasible else None) for m in METHODS[1:]]
        out.append(f"| {r['model']} | {r['tier']} | {r['gpus']} | " + " | ".join(_cell(r[m]) for m in METHODS)
                   + " | " + " | ".join(rel) + " |")
    out += ["", "### Beside the paper", "", "| paper reports | scale model | agrees? |", "|---|---|---|"]
    out += [f"| {claim} | {value} | {agrees} |" for claim, value, agrees in comparisons(hw)]
    return "\n".join(out)
