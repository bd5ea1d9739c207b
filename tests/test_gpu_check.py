"""``scripts/gpu_check.sh``, the one command for a lent GPU, on a machine without one.

``--dry-run`` prints every step, in the order of risk docs/gpu.md gives, each a
command whose script exists; a named step alone runs alone and an unknown one is
refused; without CUDA a GPU step reports SKIP with its reason (no false PASS), and
the attention check's reduced CPU form passes (the kernels at folded batch sizes,
an empty shard, a rank with no head).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/gpu_check.sh"
STEPS = ["te", "pytest-gpu", "megatron-te-fp8", "megatron-distopt", "megatron-dsp2-gloo", "primitives",
         "compile", "compile-gloo2", "fp8-payload",
         "deepspeed-zero2-fp16", "deepspeed-zero2-bf16", "deepspeed-zero3-fp16", "deepspeed-zero3-bf16",
         "attention", "sampling", "figures"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_LOGS": str(ROOT / "out/gpu_check_test")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_prints_every_step_in_order_of_risk() -> None:
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == STEPS
    for line in lines:
        command = line.split()[1:]
        assert command[0] == sys.executable, line
        if command[1].endswith(".py"):
            assert (ROOT / command[1]).is_file(), f"{line}: no such script"
    assert run("--dry-run", "attention").stdout.split()[0] == "attention"


def test_an_unknown_step_is_refused() -> None:
    proc = run("--dry-run", "tensorcores")
    assert proc.returncode == 2 and "no step 'tensorcores'; steps: te pytest-gpu" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA reports")
def test_without_cuda_a_gpu_step_is_skipped_with_its_reason() -> None:
    proc = run("primitives")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIP  primitives             no CUDA device" in proc.stdout, proc.stdout
    assert "gpu_check: 0 step(s) failed" in proc.stdout


def test_attention_check_reduced_on_the_cpu() -> None:
    proc = subprocess.run([sys.executable, "scripts/gpu_check/attention.py", "--device", "cpu", "--rows", "300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "figure: 16/16 kernel runs within 1e-05 of fp32 math" in proc.stdout
    assert "empty shard default: max error 0.0e+00, shape (0, 2, 8, 64)" in proc.stdout
    assert "empty shard math: max error 0.0e+00, shape (0, 2, 8, 64)" in proc.stdout
    assert "no head math: max error 0.0e+00, shape (4, 0, 8, 64)" in proc.stdout
