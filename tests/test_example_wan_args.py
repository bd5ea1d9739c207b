"""``examples/train_wan_deepspeed.py``: bad arguments stop every rank before any collective, with one line, exit 2
and torchrun's error file; an error outside the model's forward reaches the peers by name (issue 52, unclear 9-13,
17).

In process: the example's ``main`` with ``init_distributed`` replaced by a stub that fails the test, so "before any
collective" is checked. One real torchrun launch (2 ranks) for the error raised on rank 1 outside the forward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("diffusers")
# torchrun's record() (the example's launch_main) cannot install its fault handler on pytest's captured stderr
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_wan_deepspeed.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_wan_deepspeed", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _refused(example: ModuleType, argv: list[str], tmp: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    """Run the example's main on a 2-rank world's rank as torchrun starts it: the line, torchrun's error record."""
    import deepspeed

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("init_distributed ran: the argument should have been refused before it")

    monkeypatch.setattr(deepspeed.comm, "init_distributed", no_collective)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp / "error.json"))
    with pytest.raises(SystemExit) as exc:
        example.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err.startswith("train_wan_deepspeed.py: error: "), err
    return err, json.loads((tmp / "error.json").read_text())["message"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--dsp", "0"], "--dsp 0: expected a positive integer"),                      # was ZeroDivisionError
    (["--dsp", "x"], "argument --dsp: invalid int value: 'x'"),                    # argparse's own, in the file too
    (["--samples", "0"], "--samples 0: expected a positive integer"),              # was StopIteration after ~60 s
    (["--dsp", "1", "--samples", "1"], "--samples 1: a step takes --micro-batch 1 x 2 data-parallel ranks = 2 "
                                       "samples; expected --samples >= 2"),
    (["--size", "3"], "--size 3: the model's patch is 1x2x2, so its rows need a multiple of 2; expected e.g. "
                      "--size 4"),                                                  # was the model's shape error
    (["--size", "66"], "--size 66 gives 33 tokens along its rows, more than the model's rope_max_seq_len 32; "
                       "expected --size <= 64"),
    (["--losses-json", "/proc/losses.json"], "--losses-json '/proc' cannot be written"),   # was: after training
    (["--timeout", "0"], "--timeout 0: expected a positive number of seconds"),
])
def test_bad_arguments_stop_before_any_collective(example: ModuleType, argv: list[str], expected: str,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    err, record = _refused(example, argv, tmp_path, monkeypatch, capsys)
    assert expected in err, err
    assert expected in record["message"] and record["extraInfo"]["py_callstack"] == err, record


def _saved_at(directory: Path, dsp: int, world: int) -> Path:
    """A checkpoint directory as ``checkpoint.save`` leaves it (files and manifests), saved at ``dsp`` on ``world``."""
    from dsp_plugin.deepspeed import checkpoint

    tag = directory / "step2-abc"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"states")
    files = {"mp_rank_00_model_states.pt": checkpoint._hash(tag / "mp_rank_00_model_states.pt")}
    for rank in range(world):
        manifest = {"save_id": "abc", "tag": tag.name, "world_size": world, "dsp_size": dsp,
                    "files": files if rank == 0 else {}}
        (tag / f"dsp_manifest_rank{rank}.json").write_text(json.dumps(manifest))
    (directory / "latest").write_text(tag.name)
    return directory


def test_a_resume_at_another_dsp_size_is_refused_at_once(example: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Was refused ~96 s in, naming the cause only; now before any collective, naming the --dsp that resumes it."""
    saved = _saved_at(tmp_path / "ckpt", dsp=2, world=2)
    err, _ = _refused(example, ["--dsp", "1", "--load-dir", str(saved)], tmp_path, monkeypatch, capsys)
    assert f"--load-dir {saved} was saved at --dsp 2 on 2 ranks, this run asks --dsp 1" in err, err
    assert "expected --dsp 2 (with --nproc-per-node 2) to resume it, or no --load-dir" in err, err


_FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":   # rank 1's loss, after the model's forward: outside every parallelized module
    import torch.nn.functional

    def mse_loss(*args, **kwargs):
        raise RuntimeError("injected on rank 1, outside the model's forward")

    torch.nn.functional.mse_loss = mse_loss
"""


@pytest.mark.slow
def test_an_error_outside_the_forward_reaches_rank_0_by_name(tmp_path: Path) -> None:
    """Rank 1 raises in its loss; rank 0, waiting in the backward's collectives, raised gloo's "Connection closed by
    peer"; now ``PeerFailure`` naming rank 1's error."""
    (tmp_path / "sitecustomize.py").write_text(_FAIL_ON_RANK_1)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    # torchrun's agent looks at its workers every --monitor-interval and stops the rest once one has failed:
    # 10 s leave rank 0 the time to see its collective fail and say why, as it does on a multi-node job
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=10", str(EXAMPLE), "--dsp", "2", "--steps", "1", "--samples", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    rank0 = "\n".join(line for line in out.splitlines() if line.startswith("[rank0]"))
    assert "PeerFailure: rank 1 failed first: RuntimeError: injected on rank 1, outside the model's forward" in rank0, \
        out[-5000:]
