"""``examples/train_wan_deepspeed.py`` trains diffusers' Wan under DeepSpeed ZeRO + DSP and resumes bit-exact.

Three torchrun runs of the example as a user runs it (2 processes: DSP 2, bf16): 4 steps straight; 2 steps
saved; resumed from that save to step 4. The resumed run's losses of steps 3 and 4 equal the straight run's
bitwise, and so do the step-4 checkpoints' module weights (the manifests' save ids differ, nothing else).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["2", "3"])
def test_example_trains_and_resumes_bit_exact(tmp_path: Path, zero: str) -> None:
    common = ["--zero", zero, "--precision", "bf16"]
    straight, log = _run(tmp_path, "straight", *common, "--steps", "4", "--save-dir", str(tmp_path / "straight"))
    assert "DSP: tp(1) x dsp(2) x dp(1)" in log and "all-to-alls forward" in log, log[-3000:]   # the traffic line
    assert "step 4 loss" in log and "samples/s" in log, log[-3000:]
    first, _ = _run(tmp_path, "first", *common, "--steps", "2", "--save-dir", str(tmp_path / "first"))
    resumed, log = _run(tmp_path, "resumed", *common, "--steps", "4", "--load-dir", str(tmp_path / "first"),
                        "--save-dir", str(tmp_path / "resumed"))
    assert "resumed" in log and "at step 3" in log, log[-3000:]
    print(f"ZeRO-{zero} bf16, DSP 2: straight {straight}; first {first}; resumed {resumed}")
    assert first == {k: straight[k] for k in ("1", "2")}, (first, straight)
    assert resumed == {k: straight[k] for k in ("3", "4")}, (resumed, straight)      # bitwise (JSON floats)
    if zero == "2":                   # ZeRO-3 keeps the weights in its partitioned files, not the module file
        a, b = _module(tmp_path / "straight"), _module(tmp_path / "resumed")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "module weights differ"
