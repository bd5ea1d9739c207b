"""``python -m dsp_plugin.bench.published``: the scale models beside figures others published, then Wan 14B at scale.

Each row: a published figure, where it was published, the setting as published, and what the
scale models predict for that setting with the rates of ``params.py`` (datasheets and the stated
assumptions; ``--calibration`` replaces them with measured ones). The error is (predicted -
published) / published; beyond 20% a row is a finding (docs/benchmarks.md says why), not a
reason to retune the rates. Then DSP's head switch against Megatron's context parallelism
(``a2a`` and ``p2p``) and DeepSpeed-Ulysses for Wan 2.1 14B on 8-128 H100 (``full3d_model.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from dsp_plugin.bench import params
from dsp_plugin.bench.full3d_model import METHODS, WAN_14B
from dsp_plugin.bench.full3d_model import predict as predict_full3d
from dsp_plugin.bench.params import Hardware
from dsp_plugin.bench.scale_model import INFERENCE
from dsp_plugin.bench.scale_model import predict as predict_stdit
from dsp_plugin.bench.scale_report import e2e_rows

__all__ = ["H800", "Row", "main", "rows", "wan_rows"]

# NVIDIA H800 SXM: the H100's die with NVLink cut to 400 GB/s aggregate (200 GB/s each way; the H100's is 900);
# bf16 compute as the H100 (philisun.com, "NVIDIA H800 vs H100", no NVIDIA datasheet found). ASSUMPTION: an
# all-to-all reaches the same 78% of it as on the H100 (params.H100): 156 GB/s.
H800 = replace(params.H100, nvlink_bytes_per_s=0.78 * 200e9)

DFM = ("NVIDIA-NeMo/DFM docs/performance-summary.md (commit 0c23efe), DGX-H100 row; recipe "
       "examples/megatron/recipes/wan/conf/h100_perf_pretrain_mock.yaml (52083ac)")
VIDEOSYS = "NUS-HPC-AI-Lab/VideoSys docs/dsp.md (the DSP authors): OpenSora, 80 frames of 512x512"
LABELS = {"dsp": "DSP (Wan plan: whole frames)", "head_switch": "head switch (flat tokens)",
          "ulysses": "DeepSpeed-Ulysses", "cp_a2a": "Megatron CP a2a", "cp_p2p": "Megatron CP p2p"}
PAPER = "the DSP paper, sec 5.1 over the Table 5 settings (../shared/paper/dsp-paper.txt)"


@dataclass(frozen=True)
class Row:
    figure: str
    setting: str
    published: float
    predicted: float
    unit: str
    source: str

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def rows(hw: Hardware = params.H100, h800: Hardware = H800) -> list[Row]:
    out = []
    # Megatron-Bridge (DFM): Wan 2.1 14B pretraining, 128 H100, TP 2 with sequence parallelism, CP 4 (Megatron's
    # default cp_comm_type p2p), DP 16, 37,440 tokens a sample, micro-batch 1, recompute of 10 of 40 layers
    mb = predict_full3d("cp_p2p", WAN_14B, tokens=37440, frames=24, sp=4, tp=2, dp=16, recompute=10 / 40, hw=hw)
    out.append(Row("Wan 2.1 14B training, model TFLOP/s per GPU", "128 H100, TP2+SP, CP4 (p2p), DP16, 37,440 "
                   "tokens, recompute 10/40 layers", 325.77, mb.tflops_per_gpu, "TFLOP/s", DFM))
    # VideoSys: sampling latency; ASSUMED (the README gives frames and size only): OpenSora 1.0's STDiT-XL/2 (the
    # paper's 720M), an image VAE (80 latent frames of 32x32 = 1,024 tokens), CFG (batch 2), 100 sampling steps
    steps, model = 100, params.MODELS["720M"]

    def latency(method: str, n: int) -> float:
        return steps * predict_stdit(method, model, batch=2, temporal=80, sp=n, spatial=1024, hw=h800,
                                     factors=INFERENCE).step_s

    one, dsp, uly = latency("dsp", 1), latency("dsp", 8), latency("ulysses_paper", 8)
    setting = "sampling; ASSUMED 720M STDiT, 80 latent frames x 1,024 tokens, CFG, 100 steps"
    out += [Row("OpenSora latency, 1 x H800", setting, 106.0, one, "s", VIDEOSYS),
            Row("OpenSora latency, 8 x H800, DeepSpeed-Ulysses", setting, 45.0, uly, "s", VIDEOSYS),
            Row("OpenSora latency, 8 x H800, DSP", setting, 22.0, dsp, "s", VIDEOSYS),
            Row("OpenSora: Ulysses / DSP", setting, 45.0 / 22.0, uly / dsp, "x", VIDEOSYS),
            Row("OpenSora: 1 GPU / 8 GPUs with DSP", setting, 106.0 / 22.0, one / dsp, "x", VIDEOSYS)]
    ratios = [r["over_dsp"]["ulysses_paper"] for r in e2e_rows(hw)]
    for published, predicted, end in ((1.32, min(ratios), "low"), (1.75, max(ratios), "high")):
        out.append(Row(f"Table 5: Ulysses / DSP step time, {end} end", "128 H100, 720M and 3B at 0.5M-4M tokens, "
                       "the paper's harness", published, predicted, "x", PAPER))
    return out


def wan_rows(hw: Hardware = params.H100, *, recompute: float = 1.0) -> list[dict[str, object]]:
    """Wan 2.1 14B, 81 frames of 720x1280 (21 x 45 x 80 = 75,600 tokens), full recompute: one sample over
    N = GPUs (strong scaling), and 8-way sequence parallelism with the rest data parallel."""
    out = []
    for gpus in (8, 16, 32, 64, 128):
        for sp, dp in ((gpus, 1), (8, gpus // 8)):
            if sp == 8 and dp == 1 and out and out[-1]["gpus"] == gpus:
                continue
            preds = {m: predict_full3d(m, WAN_14B, tokens=75600, frames=21, sp=sp, dp=dp, recompute=recompute,
                                       hw=hw) for m in METHODS}
            out.append({"gpus": gpus, "sp": sp, "dp": dp, "preds": preds})
    return out


def markdown(hw: Hardware = params.H100) -> str:
    lines = ["| published figure | setting | published | predicted | error | source |",
             "|---|---|---|---|---|---|"]
    for r in rows(hw):
        flag = " **(> 20%)**" if abs(r.error) > 0.2 else ""
        lines.append(f"| {r.figure} | {r.setting} | {r.published:,.2f} {r.unit} | {r.predicted:,.2f} {r.unit} | "
                     f"{r.error:+.0%}{flag} | {r.source} |")
    lines += ["", "Wan 2.1 14B, 81 frames of 720x1280 (75,600 tokens), full recompute, H100: predicted step s "
              "(model TFLOP/s per GPU); - where the method cannot run", "",
              "| GPUs | SP x DP | " + " | ".join(LABELS[m] for m in METHODS) + " |",
              "|---|---|" + "---|" * len(METHODS)]
    for row in wan_rows(hw):
        cells = []
        for m in METHODS:
            p = row["preds"][m]  # type: ignore[index]
            cells.append(f"{p.step_s:.2f} ({p.tflops_per_gpu:.0f})" if p.feasible else f"- ({p.reason})")
        lines.append(f"| {row['gpus']} | {row['sp']} x {row['dp']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    from dsp_plugin.bench.calibration import load

    p = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.published", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", help="measured rates (dsp_plugin/bench/calibration.py)")
    hw, _ = load(p.parse_args(argv).calibration)
    text = markdown(hw)
    print(text)
    return text


if __name__ == "__main__":
    main()
