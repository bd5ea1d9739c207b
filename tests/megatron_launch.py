"""Run ``launch/run_megatron.sh`` as a user would and read Megatron's log lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?\| loss: ([0-9.E+-]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| loss value: ([0-9.E+-]+)")
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
#: linear warm-up over 2 iterations, then cosine decay to 1e-4 over --train-iters: the LR changes every iteration,
#: so a scheduler restored at the wrong step shows in the next loss (Megatron's Adam, the launch's default)
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
#: hidden and attention dropout: every training iteration draws its masks from the CPU generator
#: (``dsp_plugin.megatron.dropout``), which a resume must restore (Megatron's checkpoint holds it)
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def cpu_env() -> dict[str, str]:
    """This environment for a launch on the CPU path, as on CI, also on a GPU machine: no GPU is visible (the
    launch then picks gloo and the CPU shim, and the measured single-process losses apply); no MASTER_PORT (the
    launch picks a free port itself)."""
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    return env | {"CUDA_VISIBLE_DEVICES": ""}


def launch(*extra: str, iters: int = 3, **knobs: str) -> tuple[dict[int, float], str]:
    """``{iteration: loss}`` logged by the launch, and its stdout; fails on a non-zero exit."""
    env = cpu_env() | dict(PYTHON=sys.executable, ITERS=str(iters), OMP_NUM_THREADS="1", **knobs)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "run_megatron.sh"), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"launch {knobs} {extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "sequence parallel mode: " + knobs.get("MODE", "dsp") in proc.stdout
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(proc.stdout)}, proc.stdout


def checkpoint_tensors(ckpt: str | Path, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of the torch_dist checkpoint ``ckpt/iter_{iteration}`` (the model's weights by their
    ``sharded_state_dict`` keys, whole, and ``optimizer.*``: Adam's moments), read in this process."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(Path(ckpt) / f"iter_{iteration:07d}"))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items()
               if isinstance(m, TensorStorageMetadata)}
    load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def tensorboard_losses(board: Path) -> dict[int, float] | None:
    """``{iteration: loss}`` of the ``loss`` scalars a launch with ``--tensorboard-dir board`` wrote (each
    iteration's own loss at float32 precision; the log line prints 7 digits of an interval average), or None
    when tensorboard is not installed."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    accumulator = EventAccumulator(str(board))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars("loss")}
