"""The bench runs end to end and writes its files; the scale model reproduces the paper's settings.

Nothing here reads a time: timings are the bench's output, never a test's pass condition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsp_plugin.bench import calibration, params, scale_report
from dsp_plugin.bench.config import QUICK
from dsp_plugin.bench.report import TABLE3, exact_bytes, exact_per_layer
from dsp_plugin.bench.scale_model import HARNESS, IDEAL, METHODS, predict

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_bench_runs_and_writes_its_files(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(calibration.ENV, None)
    proc = subprocess.run([sys.executable, "-m", "dsp_plugin.bench", "--quick", "--nproc", "2", "--out", str(tmp_path),
                           "--no-costs"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[bench" in proc.stderr                                    # progress was shown
    for name in ("bench_n2.json", "bench_n2.md", "bench_n2.png", "scale_model.png", "scale_model.md", "wan_n2.md",
                 "wan_n2.json", "mixed_n2.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary = json.loads((tmp_path / "bench_n2.json").read_text())
    assert set(summary["methods"]) == {m + s for m in METHODS for s in ("", "+ckpt")}
    for name, row in summary["methods"].items():
        # the accounting saw exactly the traffic this implementation should issue, recompute included
        assert row["fwd_over_exact"] == pytest.approx(1.0), name
        assert row["bwd_over_exact"] == pytest.approx(1.0), name
        assert row["max_abs_err_vs_single"] < 1e-5, name
        assert len(row["step_times_s_per_rank"][0]) == QUICK.steps and "over_dsp" in row and "cpu_over_dsp" in row
    ck = summary["methods"]["ulysses_paper+ckpt"]
    assert ck["bwd_bytes_per_layer"] == pytest.approx(2 * ck["fwd_bytes_per_layer"])
    text = (tmp_path / "bench_n2.md").read_text()
    assert "| ulysses_paper |" in text and "Factor ladder" in text
    wan = json.loads((tmp_path / "wan_n2.json").read_text())          # the full-3D section ran, diffusers beside us
    assert wan["ours"]["all_to_all_per_layer"] == 2 and wan["diffusers"]["all_to_all_per_layer"] == 4, wan
    assert "## Full 3D: Wan" in proc.stdout and "## Mixed model" in proc.stdout


def test_bench_refuses_too_few_steps_and_unknown_methods() -> None:
    from dsp_plugin.bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--steps", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--methods", "dsp,zigzag"])


def test_table3_ordering_and_exact_volumes() -> None:
    for n in (2, 4, 8):
        t3 = {m: f(n) for m, (_, f) in TABLE3.items()}
        assert t3["dsp"] < t3["ulysses"] <= t3["ring"] < t3["megatron_sp"]
        fwd = {m: exact_per_layer(m, n, depth=28)[0] for m in TABLE3}
        assert fwd["dsp"] == pytest.approx(2 * (n - 1) / n**2 * 55 / 56)
        assert fwd["ulysses"] == pytest.approx(2 * fwd["dsp"] * 56 / 55)
        assert fwd["ulysses_paper"] == pytest.approx(2 * fwd["ulysses"])
        f, b = exact_bytes("ulysses_paper", n, QUICK, checkpointing=True)
        assert b == pytest.approx(2 * f) and f > fwd["ulysses_paper"] * QUICK.activation_bytes


def test_scale_model_reproduces_table5_within_the_band() -> None:
    rows = scale_report.e2e_rows()
    assert len(rows) == len(params.E2E)
    for r in rows:
        for m in METHODS:
            p = r["preds"][m]
            assert (p is None) == (r["sizes"][m] is None), (r["model"], r["tokens"], m)
            assert p is None or (p.feasible and p.step_s > 0)
    lo, hi = params.PAPER_E2E_DSP_OVER_ULYSSES
    paper = [r["over_dsp"]["ulysses_paper"] for r in rows]
    tol = params.PAPER_TOLERANCE
    assert (1 + lo) * (1 - tol) <= min(paper) <= (1 + lo) * (1 + tol), paper
    assert (1 + hi) * (1 - tol) <= max(paper) <= (1 + hi) * (1 + tol), paper
    best = [r["over_dsp"]["ulysses"] for r in rows]
    assert all(1.0 < b < p for b, p in zip(best, paper))             # DSP still wins, by less


def test_factor_ladder_starts_at_table3_and_ends_at_the_harness() -> None:
    steps = scale_report.ladder()
    assert steps[0]["factors"] == IDEAL and steps[-2]["factors"] == HARNESS
    for before, after in zip(steps[:-2], steps[1:-1]):            # every effect widens the gap
        for key, ratio in after["ratios"].items():
            assert ratio >= before["ratios"][key] - 1e-9, (after["label"], key)
    assert max(steps[0]["ratios"].values()) < 1.1                 # Table 3 alone: a few percent
    e2e = {(r["model"], r["tokens"]): r["over_dsp"]["ulysses_paper"] for r in scale_report.e2e_rows()}
    assert steps[-2]["ratios"] == pytest.approx(e2e)


def test_scale_model_head_limit_and_comm_ordering() -> None:
    model = params.MODELS["720M"]
    assert not predict("ulysses_paper", model, batch=1, temporal=256, sp=32).feasible     # 16 heads
    assert "head limit" in predict("megatron_sp", model, batch=1, temporal=256, sp=32).reason
    assert predict("dsp", model, batch=1, temporal=256, sp=32).feasible
    assert not predict("dsp", model, batch=1, temporal=4, sp=8).feasible                  # T < N
    comm = {m: predict(m, model, batch=1, temporal=512, sp=8).comm_s for m in METHODS}
    assert comm["dsp"] < comm["ulysses"] < comm["ulysses_paper"] < comm["megatron_sp"]
    dsp = predict("dsp", model, batch=1, temporal=512, sp=8)
    assert dsp.copy_s > 0                                                                 # DSP pays its copies
    with pytest.raises(ValueError, match="zigzag"):
        predict("zigzag", model, batch=1, temporal=512, sp=8)


def test_calibration_file_replaces_assumptions_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.chdir(tmp_path)                                   # no bench_calibration.json here
    hw, rows = calibration.load(None)
    assert hw == params.H100 and all(source.startswith("ASSUMED") for _, _, source in rows)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"layer_tflops": 300.0, "pack_unpack_gbps": 900, "source": "test rig"}))
    hw, rows = calibration.load(path)
    assert hw.flops_per_s == pytest.approx(300e12) and hw.copy_bytes_per_s == pytest.approx(900e9)
    sources = {k: s for k, _, s in rows}
    assert sources["layer_tflops"] == "MEASURED (test rig)" and sources["nvlink_gbps"].startswith("ASSUMED")
    path.write_text(json.dumps({"layer_tflop": 300.0}))
    with pytest.raises(ValueError, match="layer_tflop"):
        calibration.load(path)
    path.write_text(json.dumps({"ib_gbps": -1}))
    with pytest.raises(ValueError, match="ib_gbps=-1"):
        calibration.load(path)

    from dsp_plugin.bench.__main__ import main

    path.write_text(json.dumps({"layer_tflops": 300.0}))
    assert main(["--scale-only", "--calibration", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "MEASURED" in out and "Factor ladder" in out and "Weak scaling" in out and "Figure 8" in out
    for r in scale_report.e2e_rows():
        assert f"| {r['model']} | {r['tokens']} |" in out
