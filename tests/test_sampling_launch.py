"""``torchrun -m dsp_plugin.launch.sample_latte`` on 2 and 4 processes writes the same video as on 1.

Also the ``--pretrained`` path: the 1-process run writes the pipeline with
``save_pretrained`` and the torchrun runs load it with diffusers' ``from_pretrained``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--frames", "7", "--steps", "2", "--layers", "1"]


def _launch(nproc: int, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if nproc == 1:
        cmd = [sys.executable, "-m", "dsp_plugin.launch.sample_latte", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dsp_plugin.launch.sample_latte", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_torchrun_outputs_equal_one_process(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny-latte"
    out1 = _launch(1, *COMMON, "--save-pretrained", str(ckpt), "--out", str(tmp_path / "one.pt"))
    assert "step 1:" in out1 and (ckpt / "model_index.json").exists()
    out2 = _launch(2, *COMMON, "--pretrained", str(ckpt), "--out", str(tmp_path / "two.pt"))
    out4 = _launch(4, *COMMON, "--pretrained", str(ckpt), "--cfg-parallel", "--out", str(tmp_path / "four.pt"))
    assert "2 process(es), dsp(2)" in out2 and "4 process(es), cfg(2) x dsp(2)" in out4, out4
    one, two, four = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("one", "two", "four"))
    assert one.shape == (1, 7, 3, 16, 16)
    assert (two - one).abs().max() < 1e-5
    assert (four - one).abs().max() < 5e-5   # CFG halves on batch 1: see test_sampling_latte.py
