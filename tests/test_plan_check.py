"""``python -m dsp_plugin.plan.check``, as a user runs it: a good plan exits 0, a wrong-axis plan exits 1 naming
the first module whose output differs, a bad argument exits 2 before anything is spawned. The first two are
docs/models.md's two lines, run as printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parent.parent


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dsp_plugin.plan.check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_good_plan_exits_zero() -> None:
    run = _check("--model", "tiny-latte", "--nproc", "2")
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: equal to one process on 2 ranks" in run.stdout
    # every planned module has its row, with the collectives it issued: one switch after each block each way
    rows = {line.split()[0]: line for line in run.stdout.splitlines()[2:] if line and not line.startswith("model")}
    for path in ("pos_embed", "transformer_blocks.0", "temporal_transformer_blocks.1", "norm_out"):
        assert path in rows, run.stdout
    assert "1 all_to_all" in rows["transformer_blocks.0"] and "1 all_gather" in rows["norm_out"], run.stdout


def test_wrong_axis_plan_exits_nonzero_naming_the_module() -> None:
    run = _check("--model", "tiny-latte", "--plan", "tests.plan_check_plans:WRONG_AXIS_LATTE_PLAN", "--nproc", "2")
    print(run.stdout, run.stderr)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIFFERS: temporal_transformer_blocks.0 is the first module whose output differs" in run.stdout


def test_unknown_model_exits_two_naming_it() -> None:
    run = _check("--model", "tiny-nothing", "--nproc", "2")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "'tiny-nothing'" in run.stderr and "tiny-hunyuan-video" in run.stderr, run.stderr
