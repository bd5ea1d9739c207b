"""An error one rank sees alone reaches its peer as that error (issue 25, item 8).

Rank 1's shard fails a check inside a parallelized model's forward while rank 0 goes on to the
plan's gather. Before, rank 0 saw "Connection closed by peer" (or, with rank 1 lingering, a
timeout) naming nothing; now rank 1 posts its error in the process group's store before it
leaves, and rank 0's failed collective raises ``PeerFailure`` naming it. And the launches' mains
are decorated for torchrun's error files (``record``): a failed rank writes its error where
torchrun reads the first failure from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsp_plugin.plan import Gather, Split
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


class _ShardCheck(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from dsp_plugin.comm import group_rank

        if group_rank() == 1:
            raise ValueError(f"rank 1's shard holds {h.shape[1]} frames; this check wants 4")
        return h


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.check, self.out = nn.Linear(4, 4), _ShardCheck(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.check(self.inp(x)))


PLAN = {"inp": Split(0, "B T D", shard="T"), "out": Gather("out", "B T D")}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import dsp_plugin

    model = dsp_plugin.parallelize(_Model(), PLAN)
    start = time.perf_counter()
    try:
        model(torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(0)))
    except Exception as exc:   # noqa: BLE001 - the message is the result
        if rank == 1:
            raise                   # rank 1 leaves with its error, as a torchrun worker would
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": "no error"}


def _rank0(rank: int, world_size: int) -> dict[str, Any]:
    try:
        return _worker(rank, world_size)
    except ValueError:
        return {"error": "rank 1 raised as expected"}


def test_the_peer_names_the_first_rank_error() -> None:
    results = run_distributed(_rank0, 2, final_barrier=False, collective_timeout_s=30)
    message = results[0]["error"]
    print(f"rank 0 after {results[0].get('seconds', 0):.2f} s: {message}")
    assert message.startswith("PeerFailure: rank 1 failed first: ValueError: rank 1's shard holds 2 frames"), message
    assert results[0]["seconds"] < 25, results[0]   # not the 30 s collective timeout


def test_a_launch_writes_torchrun_error_file(tmp_path: Path) -> None:
    """train_dsp's main under torchrun's environment: each rank's error lands in its TORCHELASTIC_ERROR_FILE."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
               TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    done = subprocess.run([sys.executable, "-m", "dsp_plugin.launch.train_dsp", "--frames", "1", "--steps", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr          # an argument error: one line, argparse's status
    assert "Traceback" not in done.stderr, done.stderr
    record = json.loads((tmp_path / "error.json").read_text())
    assert "--frames=1 is smaller than the DSP size 2" in record["message"]["message"], record
