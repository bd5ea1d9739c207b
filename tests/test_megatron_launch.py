"""The real launch: ``launch/run_megatron.sh`` -> torchrun -> megatron.training argument parsing,
``initialize_megatron``, Megatron DDP, optimizer, samplers, schedules, checkpointing and evaluation (gloo).

Without a GPU the script takes ``cpu_pretrain`` (see dsp_plugin/launch/pretrain_stdit.py). One
DSP=2 run logs the single-process losses (measured once, recorded below), prints Megatron's validation loss with
``--eval-iters 2 --eval-interval 2`` and saves a torch_dist checkpoint at iteration 2;
a DSP=4 run resumes from it (another DSP size) and logs the same iteration-3 loss.
"""

from __future__ import annotations

import contextlib
import sys

import pytest

pytest.importorskip("megatron.training")

from tests.megatron_launch import ROOT, VALIDATION, launch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dsp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], str, str]:
    ckpt = str(tmp_path_factory.mktemp("ckpt_dsp2"))
    losses, out = launch("--save", ckpt, "--save-interval", "2", NPROC="2", DSP="2", EVAL_ITERS="2",
                         EVAL_INTERVAL="2")
    return losses, out, ckpt


#: ``MODE=none NPROC=1 DSP=1 ./launch/run_megatron.sh`` (single process, fp32, Megatron Adam), measured;
#: the per-layout agreement with an independent oracle is pinned by test_megatron_parallel.py
SINGLE_PROCESS = {1: 1.600200891, 2: 1.490362883, 3: 1.354884148}


def test_dsp2_launch_logs_the_single_process_losses(dsp2: tuple) -> None:
    losses = dsp2[0]
    print(f"\nlaunch losses: DSP=2 {losses}, single process (measured) {SINGLE_PROCESS}")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    assert max(abs(SINGLE_PROCESS[i] - losses[i]) for i in losses) < 1e-5, losses


def test_evaluation_prints_megatron_validation_loss(dsp2: tuple) -> None:
    found = VALIDATION.findall(dsp2[1])
    print(f"\nvalidation lines: {found}")
    assert ("2", "", found[0][2]) == found[0] and float(found[0][2]) > 0
    assert any(suffix for _, suffix, _ in found), "pretrain() evaluates once more after training"


def test_resume_at_another_dsp_size(dsp2: tuple) -> None:
    resumed, out = launch("--load", dsp2[2], "--ckpt-step", "2", NPROC="4", DSP="4")
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    print(f"\nDSP=2 -> DSP=4 resume: iteration 3 loss {resumed[3]!r} vs uninterrupted {dsp2[0][3]!r}")
    assert sorted(resumed) == [3]
    assert abs(resumed[3] - dsp2[0][3]) < 1e-6


def test_a_run_that_exits_without_error_status_is_a_failure() -> None:
    """Megatron's loader calls ``sys.exit()`` (status 0) on some errors; the launch turns that into one."""
    from dsp_plugin.launch.pretrain_stdit import exit_is_failure
    with pytest.raises(RuntimeError, match="called sys.exit\\(\\) without an error status"):
        with exit_is_failure("loading the checkpoint"):
            sys.exit()
    with pytest.raises(SystemExit), contextlib.suppress(RuntimeError):
        with exit_is_failure("x"):
            sys.exit(3)
