"""The launch script under DeepSpeed's own launcher, unchanged, against a single-process run.

``deepspeed --num_gpus 2 --module dsp_plugin.launch.train_deepspeed --deepspeed_config ...`` on
CPU (gloo), DSP=2, ZeRO-0, three steps: rank 0's loss curve must equal the same
training in one process (fp32, 1e-5). Checks the argument plumbing
(``--local_rank``, ``--deepspeed_config``), the config key, the data loader and
a clean exit. Then ``NPROC=2 DSP=2 ZERO=3 PRECISION=bf16 ./launch/run_deepspeed.sh``:
the bf16 ZeRO-3 run trains and its curve stays within ``BF16_LOSS_REL`` of the
fp32 single-process one (AdamW, as the launch config says; the gradient scale
itself is pinned with SGD in ``test_deepspeed_gradients.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAMPLES, FRAMES, SIZE = 3, 16, 4, 4
BF16_LOSS_REL = 1e-2     # per step, relative to the fp32 single-process loss


def _train_module() -> ModuleType:
    path = ROOT / "dsp_plugin" / "launch" / "train_deepspeed.py"
    spec = importlib.util.spec_from_file_location("train_deepspeed", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _reference(config: dict) -> list[float]:
    from dsp_plugin.data import dsp_dataloader
    from dsp_plugin.models import STDiT, STDiTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = STDiT(STDiTConfig.preset("tiny"))
    params = config["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                            weight_decay=params["weight_decay"])
    data = _train_module().synthetic_dataset(SAMPLES, FRAMES, SIZE)
    loader = dsp_dataloader(data, batch_size=config["train_batch_size"], shuffle=True, dp_size=1, dp_rank=0)
    losses = []
    for _, (latents, timestep, text, target) in zip(range(STEPS), loader):
        loss = torch.nn.functional.mse_loss(model(latents, timestep, text), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        opt.step()
        losses.append(loss.item())
    return losses


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_script_unchanged(tmp_path: Path) -> None:
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed")
    config = json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text())
    config["zero_optimization"]["stage"] = 0
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(config))
    losses = tmp_path / "losses.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        [launcher, "--num_gpus", "2", "--master_port", str(_free_port()),
         "--module", "dsp_plugin.launch.train_deepspeed",
         "--deepspeed_config", str(config_path), "--steps", str(STEPS), "--samples", str(SAMPLES),
         "--frames", str(FRAMES), "--size", str(SIZE), "--losses-json", str(losses)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    curve = json.loads(losses.read_text())
    reference = _reference(config)
    assert max(abs(a - b) for a, b in zip(curve, reference)) < 1e-5, f"{curve} vs single process {reference}"


@pytest.mark.slow
def test_bf16_zero3_through_run_deepspeed_sh(tmp_path: Path) -> None:
    losses = tmp_path / "losses.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2", DSP="2", ZERO="3", PRECISION="bf16", ITERS=str(STEPS),
               MASTER_PORT=str(_free_port()), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", "launch/run_deepspeed.sh", "--samples", str(SAMPLES), "--frames", str(FRAMES), "--size", str(SIZE),
         "--losses-json", str(losses)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    curve = json.loads(losses.read_text())
    reference = _reference(json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text()))
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
    print(f"bf16 ZeRO-3 DSP=2: {curve}; fp32 single process {reference}; worst relative difference {worst:.2e}")
    assert len(curve) == STEPS and worst < BF16_LOSS_REL, f"bf16 ZeRO-3 {curve} vs fp32 single process {reference}"
