"""Output paths are checked before the work; disk-full and a deleted manifest name themselves (issue 25, item 9).

Before: ``sample_latte --out`` into a missing or unwritable directory failed on rank 0 after sampling
(the frames lost, its peers told nothing); Megatron's ``--save`` into one failed after training; a full
disk during a DeepSpeed save said "file write failed", naming neither disk nor path; a deleted manifest
was reported as "mixes saves". The unwritable path here is one under a regular file (NotADirectoryError),
which no user, root included, can write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _blocked(tmp: Path) -> Path:
    (tmp / "a_file").write_text("")
    return tmp / "a_file" / "out"


def _sample_with_bad_out(rank: int, world_size: int, out: str) -> dict[str, Any]:
    from dsp_plugin.launch import sample_latte

    start = time.perf_counter()
    try:
        sample_latte.main(["--frames", "3", "--steps", "1", "--layers", "1", "--out", out])
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": "no error"}


def test_sample_out_is_checked_before_sampling_on_every_rank(tmp_path: Path) -> None:
    out = str(_blocked(tmp_path) / "video.pt")
    results = run_distributed(_sample_with_bad_out, 2, out)
    for rank, d in enumerate(results):
        print(f"rank {rank} ({d['seconds']:.2f} s): {d['error']}")
    assert results[0]["error"].startswith(f"OutputPathError: --out {str(Path(out).parent)!r} cannot be written")
    assert results[1]["error"].startswith("CrossRankMismatch: dsp_plugin.launch.sample_latte: rank 0 failed its own "
                                          "check before the work, so every rank stops here: OutputPathError: --out")


def test_train_dsp_and_deepspeed_outputs_are_checked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    from dsp_plugin.launch import train_dsp
    from dsp_plugin.paths import OutputPathError

    bad = _blocked(tmp_path) / "losses.json"
    monkeypatch.setattr(sys, "argv", ["train_dsp", "--steps", "1", "--out", str(bad)])
    with pytest.raises(SystemExit) as info:          # an argument error: one line, argparse's status
        train_dsp.main()
    assert info.value.code == 2
    assert re.search(r"dsp_plugin\.launch\.train_dsp: error: --out .* cannot be written", capsys.readouterr().err)
    with pytest.raises(OutputPathError, match="--out .* cannot be written"):    # the check itself
        train_dsp.preflight(train_dsp.parse_args(), 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    from tests.test_reliability_launch import _preflight_error

    good = json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text())
    assert "--losses-json" in _preflight_error(tmp_path, good, losses_json=str(bad))


@pytest.mark.slow
def test_megatron_save_is_checked_before_training(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env |= dict(PYTHON=sys.executable, ITERS="2", OMP_NUM_THREADS="1", NPROC="2", DSP="2")
    done = subprocess.run(["bash", str(ROOT / "launch" / "run_megatron.sh"), "--save", str(_blocked(tmp_path)),
                           "--save-interval", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    text = done.stdout + done.stderr
    assert done.returncode != 0
    # every rank checks before pretrain(), one line each; torchrun (its error files) names the first failure
    assert "Root Cause (first observed failure)" in text, text[-3000:]
    assert "dsp_plugin.launch.pretrain_stdit: error: --save" in text and "cannot be written" in text, text[-3000:]
    assert " iteration " not in done.stdout


def test_a_deleted_manifest_is_named(tmp_path: Path) -> None:
    from dsp_plugin.deepspeed.checkpoint import CheckpointError, check_load_dir

    tag = tmp_path / "step2-abc"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("step2-abc")
    (tag / "dsp_manifest_rank0.json").write_text(json.dumps({"save_id": "abc", "tag": "step2-abc", "world_size": 2,
                                                             "files": {}}))
    with pytest.raises(CheckpointError, match=r"is missing manifest\(s\) \['dsp_manifest_rank1.json'\] of its 2"):
        check_load_dir(tmp_path)


def _save_on_a_full_disk(rank: int, world_size: int, save_dir: str) -> str:
    import resource
    import signal

    import torch

    from tests.deepspeed_harness import setup_worker

    setup_worker(rank, world_size)
    import deepspeed

    from dsp_plugin.deepspeed import checkpoint, skip_cpu_shm_build

    skip_cpu_shm_build()   # the CPU accelerator's shared-memory op, which training never uses
    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(64, 64), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails (EFBIG) instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))   # as a full disk: the model states do not fit
    try:
        checkpoint.save(engine, save_dir, step=1)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return "no error"


@pytest.mark.slow
def test_a_failed_write_during_a_deepspeed_save_names_the_path_and_the_disk(tmp_path: Path) -> None:
    message = run_distributed(_save_on_a_full_disk, 1, str(tmp_path / "ckpt"))[0]
    print(message)
    assert message.startswith(f"CheckpointError: saving checkpoint '{tmp_path / 'ckpt'}/step1-"), message
    assert "failed writing" in message and "GiB free of" in message and "filesystem mounted at" in message
