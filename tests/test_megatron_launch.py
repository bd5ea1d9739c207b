"""The real launch: ``launch/run_megatron.sh`` -> torchrun -> ``megatron.training.pretrain()`` and its
``train()`` (gloo, under ``dsp_plugin.megatron.cpu.cuda_shim(training=True)``; no loop of ours).

Two 20-iteration runs with Megatron's Adam and a learning rate that changes every iteration (warm-up,
then cosine decay): one process (``MODE=none``, no DSP code) and DSP=2, which also prints Megatron's
validation loss (``--eval-iters 2 --eval-interval 2``). Every iteration's loss and the final weights of
the DSP run equal the one process's within fp32 rounding. Both save at iteration 16 (and 20); three
resumes from there run iterations 17-20: one process and DSP=2 bit for bit equal to their uninterrupted
runs, and DSP=4 (another DSP size) within fp32 rounding of DSP=2. ``train()``'s own options:
``--exit-interval``, ``--log-interval``, ``--tensorboard-dir`` (loss scalars), ``--overlap-grad-reduce``
and ``--log-throughput`` (this model's FLOPs hook, called by ``train()``).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

from tests.megatron_launch import (  # noqa: E402
    ROOT,
    SCHEDULE,
    VALIDATION,
    checkpoint_tensors,
    cpu_env,
    launch,
    tensorboard_losses,
)
from tests.trajectory import weight_differences  # noqa: E402

pytestmark = pytest.mark.slow

ITERS, SAVED = 20, 16
#: fp32, DSP=2 against one process over 20 Adam steps: the DSP run sums each gradient in another order (per
#: shard, then over the group), so it rounds differently. Measured: 1.2e-7 on losses, 1.2e-7 on weights (the
#: key biases' rounding-noise gradients aside, see tests/trajectory.py: 1.9e-4, under the LRs' sum 1.1e-2).
LOSS_TOL, WEIGHT_TOL = 1e-6, 1e-6


@dataclass(frozen=True)
class Run:
    losses: dict[int, float]        # Megatron's log lines (7 digits)
    exact: dict[int, float]         # TensorBoard's float32 loss of each iteration
    out: str
    ckpt: str
    weights: dict[str, torch.Tensor]  # the model's weights saved at the last iteration
    second_moment: dict[str, torch.Tensor]  # Adam's exp_avg_sq there, by the same keys


def _run(ckpt: Path, board: Path, *extra: str, **knobs: str) -> Run:
    losses, out = launch(*extra, "--save-interval", str(SAVED), "--tensorboard-dir", str(board), *SCHEDULE,
                         iters=ITERS, **knobs)
    saved = checkpoint_tensors(ckpt, ITERS)
    weights = {k: v for k, v in saved.items() if not k.startswith("optimizer.") and "_extra_state" not in k}
    moments = {k: saved[f"optimizer.state.exp_avg_sq.{k}"] for k in weights}
    return Run(losses, tensorboard_losses(board), out, str(ckpt), weights, moments)


@pytest.fixture(scope="module")
def dsp2(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Megatron's auto-resume idiom: ``--save D --load D`` on an empty D (the first run of a job)."""
    ckpt = tmp_path_factory.mktemp("ckpt_dsp2")
    return _run(ckpt, tmp_path_factory.mktemp("tb_dsp2"), "--save", str(ckpt), "--load", str(ckpt),
                NPROC="2", DSP="2", EVAL_ITERS="2", EVAL_INTERVAL="2")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One process without DSP (``MODE=none``): the reference of the DSP runs."""
    ckpt = tmp_path_factory.mktemp("ckpt_single")
    return _run(ckpt, tmp_path_factory.mktemp("tb_single"), "--save", str(ckpt), MODE="none", NPROC="1", DSP="1")


#: ``MODE=none NPROC=1 DSP=1 ./launch/run_megatron.sh`` (single process, fp32, Megatron Adam, constant LR), measured;
#: each line is its own iteration's loss (``compat.reset_log_on_first_boundary``; Megatron 0.19 printed
#: mean(1.600201, 1.490363) = 1.545282 at iteration 2).
SINGLE_PROCESS = {1: 1.600201, 2: 1.490363, 3: 1.354884}
#: the per-iteration losses of the same run (9 digits; TensorBoard's ``loss`` scalar)
SINGLE_PROCESS_PER_ITERATION = {1: 1.600200891, 2: 1.490362883}


def test_twenty_iterations_of_dsp2_equal_one_process(dsp2: Run, single: Run) -> None:
    """Every iteration's loss (TensorBoard's float32 and the log line) and the final weights. Megatron's own
    defaults, --bias-gelu-fusion included (its fused bias-GELU is the DiT's tanh GELU)."""
    assert "bias_gelu_fusion ................................ True" in dsp2.out
    iterations = list(range(1, ITERS + 1))
    assert sorted(dsp2.exact) == sorted(single.exact) == sorted(dsp2.losses) == sorted(single.losses) == iterations
    loss_diff = max(abs(dsp2.exact[i] - single.exact[i]) for i in iterations)
    weights, noise, where = weight_differences(dsp2.weights, single.weights, single.second_moment)
    lr_sum = sum(float(m.group(1)) for m in re.finditer(r"learning rate: ([0-9.E+-]+) \|", single.out))
    print(f"\n20 iterations, DSP=2 against one process: losses {[round(dsp2.exact[i], 6) for i in iterations]}; "
          f"largest loss difference {loss_diff:.3g}, largest weight difference {weights:.3g}; where the gradient "
          f"is rounding noise ({len(where)} tensors, e.g. {where[:1]}): {noise:.3g} (bound: the LRs' sum {lr_sum:.3g})")
    assert dsp2.exact[ITERS] < 0.8 * dsp2.exact[1], "the loss should fall"
    assert loss_diff < LOSS_TOL, {i: (dsp2.exact[i], single.exact[i]) for i in iterations}
    assert max(abs(dsp2.losses[i] - single.losses[i]) for i in iterations) < 2e-6 + LOSS_TOL
    assert weights < WEIGHT_TOL and noise < lr_sum, (weights, noise)


def test_fp8_switch_flag_through_pretrain_keeps_the_loss_curve() -> None:
    """``--dsp-comm-dtype fp8`` on the launch's command line, parsed by Megatron's own parser (the extra-args
    hook) and carried by ``pretrain()`` to every switch: the loss stays within 1% of the single process at every
    iteration, and is not the fp32 wire's (the payload is in use). Measured: 1.601307, 1.488479, 1.354005."""
    losses, out = launch("--dsp-comm-dtype", "fp8", NPROC="2", DSP="2")
    print(f"\nlaunch losses with the FP8 wire: {losses}, single process (measured) {SINGLE_PROCESS}")
    assert re.search(r"dsp_comm_dtype \.+ fp8", out), out[-3000:]
    assert sorted(losses) == [1, 2, 3], losses
    assert all(abs(losses[i] - SINGLE_PROCESS[i]) < 0.01 * SINGLE_PROCESS[i] for i in losses), losses
    assert max(abs(losses[i] - SINGLE_PROCESS[i]) for i in losses) > 2e-6, losses


def test_evaluation_prints_megatron_validation_loss(dsp2: Run) -> None:
    found = VALIDATION.findall(dsp2.out)
    print(f"\nvalidation lines: {found}")
    assert ("2", "", found[0][2]) == found[0] and float(found[0][2]) > 0
    assert any(suffix for _, suffix, _ in found), "pretrain() evaluates once more after training"


def test_the_launch_logs_what_dsp_did_in_iteration_1(dsp2: Run) -> None:
    """pretrain()'s own train() runs a wrapped train_step once counted: the groups, the all-to-alls, the bytes."""
    out = dsp2.out
    assert "DSP: tp(1) x dsp(2) x dp(1) x pp(1) = 2" in out and "DSP groups [[0, 1]]" in out, out[-3000:]
    traffic = re.search(r"DSP step traffic \(this rank\): (\d+) all-to-alls forward, (\d+) backward", out)
    assert traffic and int(traffic.group(1)) > 0 and traffic.group(1) == traffic.group(2), out[-3000:]
    assert out.count("DSP step traffic") == 1, "only iteration 1 is counted"


def test_the_first_run_of_save_d_load_d_starts_fresh_and_says_so(dsp2: Run) -> None:
    """The fixture's run is the first of a job using Megatron's auto-resume idiom: it trains (the losses above)
    and logs that it starts from scratch."""
    assert "is the --save directory and holds no checkpoint yet: starting from scratch" in dsp2.out


def _resume(run: Run, tmp_path: Path, *extra: str, **knobs: str) -> tuple[dict[int, float], dict[int, float]]:
    """Iterations 17-20 resumed from ``run``'s iteration-16 checkpoint: the log lines and TensorBoard's losses."""
    board = tmp_path / "tb_resumed"
    losses, out = launch(*extra, "--ckpt-step", str(SAVED), "--tensorboard-dir", str(board), *SCHEDULE,
                         iters=ITERS, **knobs)
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    exact = tensorboard_losses(board)
    after = list(range(SAVED + 1, ITERS + 1))
    assert sorted(losses) == sorted(exact) == after, (losses, exact)
    return losses, exact


@pytest.mark.parametrize("which", ["single", "dsp2"])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(which: str, request: pytest.FixtureRequest,
                                                          tmp_path: Path) -> None:
    """One process and DSP=2, each resumed from its own iteration-16 checkpoint (Adam's moments, the scheduler
    at a decaying LR, the consumed samples, the RNG states): iterations 17-20 (the loss of 20 shows the third
    optimizer step after the resume) equal the uninterrupted run's float32 losses exactly."""
    run: Run = request.getfixturevalue(which)
    knobs = {"MODE": "none", "NPROC": "1", "DSP": "1"} if which == "single" else {"NPROC": "2", "DSP": "2"}
    losses, exact = _resume(run, tmp_path, "--load", run.ckpt, **knobs)
    print(f"\n{which} resumed at {SAVED}: {exact} vs uninterrupted {[run.exact[i] for i in exact]}")
    assert exact == {i: run.exact[i] for i in exact}
    assert losses == {i: run.losses[i] for i in losses}


def test_resume_at_another_dsp_size(dsp2: Run, tmp_path: Path) -> None:
    """The second run of the same ``--save D --load D`` job, at DSP=4 from DSP=2's iteration 16: within fp32
    rounding of the uninterrupted DSP=2 run (4 ranks sum each gradient in another order than 2)."""
    _, exact = _resume(dsp2, tmp_path, "--save", dsp2.ckpt, "--load", dsp2.ckpt, "--save-interval", str(SAVED),
                       NPROC="4", DSP="4")
    diff = max(abs(exact[i] - dsp2.exact[i]) for i in exact)
    print(f"\nDSP=2 -> DSP=4 resume at {SAVED}: {exact} vs uninterrupted DSP=2 "
          f"{[dsp2.exact[i] for i in exact]}; largest difference {diff:.3g}")
    assert diff < LOSS_TOL


def test_train_options_exit_log_interval_tensorboard_overlap(tmp_path) -> None:
    """``--exit-interval 2 --log-interval 2 --tensorboard-dir D`` on 4 iterations: Megatron's train() logs
    iteration 2 (and iteration 1, which it always logs), stops at 2 and leaves loss scalars in D;
    ``--overlap-grad-reduce`` keeps the single-process losses; ``--log-throughput`` prints this model's FLOPs."""
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board = tmp_path / "tb"
    losses, out = launch("--exit-interval", "2", "--log-interval", "2", "--tensorboard-dir", str(board),
                         "--overlap-grad-reduce", "--log-throughput", iters=4, NPROC="2", DSP="2")
    assert "overlap_grad_reduce ............................. True" in out
    assert sorted(losses) == [1, 2] and "exiting program at iteration 2" in out, losses
    assert re.search(r" iteration\s+2/\s+4 \|.*\| throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \|", out)
    events = sorted(board.glob("events.out.tfevents.*"))
    assert events, f"no event file in {board}"
    accumulator = tensorboard.EventAccumulator(str(board))
    accumulator.Reload()
    scalars = {e.step: e.value for e in accumulator.Scalars("loss")}
    print(f"\nlogged {losses}; TensorBoard loss {scalars} ({events[0].name})")
    assert sorted(scalars) == [1, 2]
    assert max(abs(scalars[i] - SINGLE_PROCESS_PER_ITERATION[i]) for i in scalars) < 1e-6


def test_two_launches_on_one_machine_get_their_own_port(tmp_path) -> None:
    """Without ``MASTER_PORT`` each launch takes a free port: two at once both run (the script holds its
    rendezvous store open while the other starts)."""
    script = tmp_path / "hold.py"
    script.write_text("import os, time\nprint('port', os.environ['MASTER_PORT'], flush=True)\ntime.sleep(3)\n")
    env = cpu_env() | {"PYTHON": sys.executable, "SCRIPT": str(script), "NPROC": "1", "DSP": "1"}
    runs = [subprocess.Popen(["bash", str(ROOT / "launch" / "run_megatron.sh")], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    ports = [re.search(r"port (\d+)", out).group(1) for out in outs]
    print(f"\nports: {ports}")
    assert ports[0] != ports[1]


def test_a_run_that_exits_without_error_status_is_a_failure() -> None:
    """Megatron's loader calls ``sys.exit()`` (status 0) on some errors; the launch turns that into one."""
    from dsp_plugin.megatron.compat import exit_is_failure

    with pytest.raises(RuntimeError, match="called sys.exit\\(\\) without an error status"):
        with exit_is_failure("loading the checkpoint"):
            sys.exit()
    with pytest.raises(SystemExit), contextlib.suppress(RuntimeError):
        with exit_is_failure("x"):
            sys.exit(3)


def test_cpu_refuses_options_whose_megatron_code_asserts_cuda() -> None:
    """Checked right after parsing on every rank (before pretrain() opens the process group)."""
    import argparse

    from dsp_plugin.launch.pretrain_stdit import refuse_cuda_only_options

    args = argparse.Namespace(use_distributed_optimizer=False, bf16=True, fp16=False, distributed_backend="gloo")
    with pytest.raises(ValueError, match="--bf16: needs CUDA, Megatron's distributed and mixed-precision"):
        refuse_cuda_only_options(args)
    args.bf16, args.distributed_backend = False, "nccl"
    with pytest.raises(ValueError, match="--distributed-backend nccl: there is no CUDA here; use gloo"):
        refuse_cuda_only_options(args)
    args.distributed_backend = "gloo"
    refuse_cuda_only_options(args)
