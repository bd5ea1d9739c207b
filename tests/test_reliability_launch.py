"""Issue 16's launch cases: bad arguments stop every rank with a clear error before any collective.

``--frames`` below the DSP size used to kill rank 1 in conv3d on an empty shard
while rank 0 saw "connection closed"; a DeepSpeed config without (or with a
misspelled) ``sequence_parallel_mode`` died after minutes in torch's loader
("batch_size=4.0"); a missing ``--load-dir`` or an unwritable ``--save-dir`` gave
DeepSpeed's bare assertion; Megatron's ``--load`` of nothing trained from scratch
with exit 0. Two 2-rank runs (torchrun's environment) show the error on both ranks; the rest calls the
launch's own preflight in this process (it issues no collective by design).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    """The launch on 2 ranks, with torchrun's environment, each rank left to finish on its own.

    torchrun's agent SIGTERMs every other rank as soon as one fails, so whether a slower rank got to print its own
    error is a race (seen in the merged suite: rank 1 killed while importing). The ranks are started here as
    torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), without the agent: a rank that waited
    for its peer in a collective would hang to the timeout instead of printing.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, "-m", f"dsp_plugin.launch.{script}", *args]
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    return subprocess.CompletedProcess(cmd, max(abs(p.returncode) for p in ranks),
                                       "".join(o for o, _ in outs), "".join(e for _, e in outs))


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"dsp_plugin.launch.{name}")


def test_train_dsp_frames_below_dsp_size_fails_on_every_rank() -> None:
    done = _torchrun("train_dsp", "--frames", "1", "--steps", "1")
    text = done.stdout + done.stderr
    message = "dsp_plugin.launch.train_dsp: error: --frames=1 is smaller than the DSP size 2"
    assert done.returncode == 2, (done.returncode, text[-3000:])      # argparse's status for a usage error
    assert text.count(message) == 2, text[-3000:]          # both ranks, one line each
    assert len(done.stderr.strip().splitlines()) == 2, done.stderr     # and nothing else: no traceback
    assert "Kernel size" not in text and "Connection closed" not in text


def test_train_dsp_dsp_size_that_does_not_divide_the_world_is_one_line() -> None:
    done = _torchrun("train_dsp", "--dsp", "3", "--steps", "1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("dsp_plugin.launch.train_dsp: error: --dsp 3 does not divide the world size 2") == 2, \
        done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
def test_train_deepspeed_frames_below_dsp_size_fails_on_every_rank() -> None:
    done = _torchrun("train_deepspeed", "--deepspeed_config", "launch/ds_config_dsp.json", "--frames", "1")
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert text.count("dsp_plugin.launch.train_deepspeed: error: --frames=1 is smaller than the DSP size 2") == 2, \
        text[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def _preflight_error(tmp_path: Path, config: dict, **overrides: object) -> str:
    train = _module("train_deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = Namespace(deepspeed_config=str(path), frames=8, size=8, save_dir=None, load_dir=None, losses_json=None)
    for key, value in overrides.items():
        setattr(args, key, value)
    with pytest.raises((ValueError, RuntimeError)) as info:
        train.preflight(args)
    return str(info.value)


def test_train_deepspeed_preflight_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    good = json.loads((ROOT / "launch" / "ds_config_dsp.json").read_text())
    missing = {k: v for k, v in good.items() if k != "sequence_parallel_mode"}
    assert "trains with DSP, but the config has no 'sequence_parallel_mode' key" in _preflight_error(tmp_path, missing)
    typo = dict(missing, sequence_paralel_mode="dsp")
    assert "did you mean 'sequence_parallel_mode'" in _preflight_error(tmp_path, typo)
    assert "--load-dir" in _preflight_error(tmp_path, good, load_dir=str(tmp_path / "nowhere"))
    (tmp_path / "file").write_text("")
    assert "cannot be written" in _preflight_error(tmp_path, good, save_dir=str(tmp_path / "file" / "ckpt"))


def test_megatron_load_of_nothing_is_refused_unless_it_is_the_save_directory(tmp_path: Path) -> None:
    """Megatron's auto-resume idiom (the same ``--save D --load D`` on every run, the first included) starts
    fresh and says so; ``--load`` of another directory without a checkpoint is refused."""
    from dsp_plugin.megatron.resume import check_load_path

    def args(load: object, save: object = None, allow: bool = False) -> Namespace:
        return Namespace(load=load, save=save, allow_fresh_start=allow, ckpt_step=None)

    with pytest.raises(ValueError, match="does not exist and is not the --save directory.*--allow-fresh-start"):
        check_load_path(args(str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="holds no Megatron checkpoint .* and is not the --save directory"):
        check_load_path(args(str(tmp_path), save=str(tmp_path / "other")))
    for load in (tmp_path, tmp_path / "new"):  # an empty or a missing --save directory: the first run of a job
        note = check_load_path(args(str(load), save=str(load) + "/"))
        assert note and "is the --save directory and holds no checkpoint yet: starting from scratch" in note
    assert "starting from scratch (--allow-fresh-start)" in check_load_path(args(str(tmp_path / "x"), allow=True))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert check_load_path(args(str(tmp_path))) is None
    assert check_load_path(args(None)) is None
