"""``dsp-train`` (``dsp_plugin.launch.train_dsp``) resumed from its checkpoint equals the uninterrupted run.

Two torchrun runs of 2 processes (DSP=2), AdamW with a warm-up then a decay (``--warmup-steps 2
--decay-steps 7``: the LR changes every step), the launch's ``dsp_dataloader`` (shuffled): 6 steps
straight, saving at steps 2, 4 and 6; then a run resumed from the step-2 save (``--load-dir``) to step 6.
Steps 3-6's losses (step 6's shows the third optimizer step after the resume) are equal bitwise, and so are
the step-6 checkpoints' weights and Adam moments.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVED = 6, 2
TINY = ["--frames", "4", "--height", "4", "--width", "4", "--batch-size", "2", "--optimizer", "adamw",
        "--lr", "1e-3", "--warmup-steps", "2", "--decay-steps", "7", "--steps", str(STEPS)]


def _run(tmp: Path, name: str, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DSP_BACKEND="gloo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "dsp_plugin.launch.train_dsp", *TINY, "--out", str(tmp / f"{name}.json"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((tmp / f"{name}.json").read_text()), done.stdout


def _state(save_dir: Path, step: int) -> dict:
    return torch.load(save_dir / f"step{step}" / "state.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, _ = _run(tmp_path, "straight", "--save-dir", str(tmp_path / "straight"), "--save-every", str(SAVED))
    first = tmp_path / "first"
    shutil.copytree(tmp_path / "straight" / f"step{SAVED}", first / f"step{SAVED}")
    (first / "latest").write_text(f"step{SAVED}\n")
    resumed, log = _run(tmp_path, "resumed", "--load-dir", str(first), "--save-dir", str(tmp_path / "resumed"))
    assert f"resumed {first} at step {SAVED + 1}" in log, log[-3000:]
    print(f"\ndsp-train DSP=2: straight {straight['losses']}; resumed at step {SAVED + 1}: {resumed['losses']}")
    assert straight["dsp"] == 2 and straight["first_step"] == 1 and resumed["first_step"] == SAVED + 1
    assert resumed["losses"] == straight["losses"][SAVED:], (resumed, straight)           # bitwise
    a, b = _state(tmp_path / "straight", STEPS), _state(tmp_path / "resumed", STEPS)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "weights differ"
    moments = [(x[key], y[key]) for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values())
               for key in ("exp_avg", "exp_avg_sq")]
    assert moments and all(torch.equal(x, y) for x, y in moments), "Adam's moments differ"
    assert a["scheduler"] == b["scheduler"] and a["loader"] == b["loader"]
