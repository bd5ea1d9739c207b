"""``examples/train_wan_deepspeed.py`` trains diffusers' Wan under DeepSpeed ZeRO + DSP and resumes bit-exact.

Two torchrun runs of the example as a user runs it (2 processes: DSP 2), ZeRO-2 in fp32 and ZeRO-3 in bf16:
6 steps straight, saving at steps 2, 4 and 6; then a run resumed from the step-2 save to step 6. Both use
the example's AdamW with a warm-up then a decay (``--warmup-steps 2 --decay-steps 6``: the LR changes every
step) and its loader (the data position travels in the checkpoint). The resumed run's losses of steps 3-6
(step 6's shows the third optimizer step after the resume) equal the straight run's bitwise, and so do the
step-6 checkpoints' module weights (ZeRO-2; ZeRO-3 keeps them in its partitioned files).
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

pytest.importorskip("deepspeed")
pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVED = 6, 2


def _run(tmp: Path, name: str, *args: str) -> tuple[dict[str, float], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "examples/train_wan_deepspeed.py", "--dsp", "2", "--losses-json", str(tmp / f"{name}.json"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((tmp / f"{name}.json").read_text()), done.stderr


def _module(save_dir: Path) -> dict[str, torch.Tensor]:
    tag = (save_dir / "latest").read_text().strip()
    state = torch.load(save_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return state["module"]


def _only_save(save_dir: Path, step: int, into: Path) -> Path:
    """A directory whose ``latest`` is ``save_dir``'s save of ``step`` (the tag copied whole, manifests included)."""
    tag = next(p.name for p in save_dir.iterdir() if p.is_dir() and p.name.startswith(f"step{step}-"))
    shutil.copytree(save_dir / tag, into / tag)
    (into / "latest").write_text(tag)
    return into


@pytest.mark.slow
@pytest.mark.parametrize("zero, precision", [("2", "fp32"), ("3", "bf16")])
def test_example_trains_and_resumes_bit_exact(tmp_path: Path, zero: str, precision: str) -> None:
    common = ["--zero", zero, "--precision", precision, "--steps", str(STEPS), "--warmup-steps", "2",
              "--decay-steps", str(STEPS)]
    straight, log = _run(tmp_path, "straight", *common, "--save-dir", str(tmp_path / "straight"),
                         "--save-every", str(SAVED))
    assert "DSP: tp(1) x dsp(2) x dp(1)" in log and "all-to-alls forward" in log, log[-3000:]   # the traffic line
    assert f"step {STEPS} loss" in log and "samples/s" in log, log[-3000:]
    first = _only_save(tmp_path / "straight", SAVED, tmp_path / "first")
    resumed, log = _run(tmp_path, "resumed", *common, "--load-dir", str(first), "--save-dir", str(tmp_path / "resumed"))
    assert "resumed" in log and f"at step {SAVED + 1}" in log, log[-3000:]
    print(f"ZeRO-{zero} {precision}, DSP 2: straight {straight}; resumed at step {SAVED + 1}: {resumed}")
    assert resumed == {k: straight[k] for k in map(str, range(SAVED + 1, STEPS + 1))}, (resumed, straight)  # bitwise
    if zero == "2":                   # ZeRO-3 keeps the weights in its partitioned files, not the module file
        a, b = _module(tmp_path / "straight"), _module(tmp_path / "resumed")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "module weights differ"
