"""The real launch: ``launch/run_megatron.sh`` -> torchrun -> megatron.training argument parsing,
``initialize_megatron``, Megatron DDP, samplers and schedules (gloo on CPU).

Without a GPU the script takes ``cpu_pretrain`` (see launch/pretrain_stdit.py for
which pieces of ``pretrain()`` that replaces and why). The DSP=2 run on two
processes must log the losses of the single-process ``--sequence-parallel-mode
none`` run: same seed, same synthetic samples, layout-independent weights.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \| loss: ([0-9.E+-]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(**knobs: str) -> list[float]:
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=str(_free_port()), ITERS="3", OMP_NUM_THREADS="1",
               **knobs)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "run_megatron.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"launch {knobs} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    losses = [float(m.group(2)) for m in LOSS.finditer(proc.stdout)]
    assert len(losses) == 3, f"expected 3 logged losses from {knobs}, got {losses}\n{proc.stdout[-3000:]}"
    assert "sequence parallel mode: " + knobs.get("MODE", "dsp") in proc.stdout
    return losses


@pytest.mark.slow
def test_dsp2_launch_logs_the_single_process_losses() -> None:
    single = launch(MODE="none", NPROC="1", DSP="1")
    dsp = launch(NPROC="2", DSP="2")
    print(f"\nlaunch losses: single process {single}, DSP=2 {dsp}")
    assert single[-1] < single[0]
    assert max(abs(a - b) for a, b in zip(single, dsp, strict=True)) < 1e-5, (single, dsp)
