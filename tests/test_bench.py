"""The bench runs end to end and writes its files; the scale model covers the paper's settings.

Nothing here reads a time: timings are the bench's output, never a test's pass condition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsp_plugin.bench import params, scale_report
from dsp_plugin.bench.report import TABLE3, exact_per_layer
from dsp_plugin.bench.scale_model import METHODS, predict

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_bench_runs_and_writes_its_files(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dsp_plugin.bench", "--quick", "--nproc", "2", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[bench" in proc.stderr                                    # progress was shown
    for name in ("bench_n2.json", "bench_n2.md", "bench_n2.png", "scale_model.png", "scale_model.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    summary = json.loads((tmp_path / "bench_n2.json").read_text())
    assert set(summary["methods"]) == set(METHODS)
    for method, row in summary["methods"].items():
        # the accounting saw exactly the traffic this implementation should issue
        assert row["fwd_over_exact"] == pytest.approx(1.0), method
        assert row["bwd_over_exact"] == pytest.approx(1.0), method
        assert row["max_abs_err_vs_single"] < 1e-5, method
        assert len(row) > 5 and "median_step_s" in row
    assert "| dsp |" in (tmp_path / "bench_n2.md").read_text()


def test_bench_refuses_too_few_steps() -> None:
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


def test_scale_model_covers_the_paper_settings() -> None:
    rows = scale_report.e2e_rows()
    assert len(rows) == len(params.E2E) * len(METHODS)
    for r in rows:
        if r["pred"] is not None:
            assert r["pred"].feasible and r["pred"].step_s > 0, r
    text = scale_report.markdown()
    for setting in params.E2E:
        assert f"| {setting.model} | {setting.tokens} |" in text
    assert "Beside the paper" in text


def test_scale_model_head_limit_and_comm_ordering() -> None:
    model = params.MODELS["720M"]
    assert not predict("ulysses", model, batch=1, temporal=256, sp=32).feasible      # 16 heads
    assert predict("dsp", model, batch=1, temporal=256, sp=32).feasible
    comm = {m: predict(m, model, batch=1, temporal=512, sp=8).comm_s for m in METHODS}
    assert comm["dsp"] < comm["ulysses"] < comm["megatron_sp"]
