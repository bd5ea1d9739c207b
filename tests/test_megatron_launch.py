"""The real launch: ``launch/run_megatron.sh`` -> torchrun -> ``megatron.training.pretrain()`` and its
``train()`` (gloo, under ``dsp_plugin.megatron.cpu.cuda_shim(training=True)``; no loop of ours).

One DSP=2 run logs the single-process losses (measured once, recorded below), prints Megatron's validation
loss with ``--eval-iters 2 --eval-interval 2`` and saves a torch_dist checkpoint at iteration 2; a DSP=4 run
with a larger ``--train-iters`` resumes from it (another DSP size) and logs the same iteration-3 loss.
``train()``'s own options: ``--exit-interval``, ``--log-interval``, ``--tensorboard-dir`` (loss scalars),
``--overlap-grad-reduce`` and ``--log-throughput`` (this model's FLOPs hook, called by ``train()``).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training")

from tests.megatron_launch import ROOT, VALIDATION, cpu_env, launch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dsp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], str, str]:
    """Megatron's auto-resume idiom: ``--save D --load D`` on an empty D (the first run of a job)."""
    ckpt = str(tmp_path_factory.mktemp("ckpt_dsp2"))
    losses, out = launch("--save", ckpt, "--load", ckpt, "--save-interval", "2", NPROC="2", DSP="2",
                         EVAL_ITERS="2", EVAL_INTERVAL="2")
    return losses, out, ckpt


#: ``MODE=none NPROC=1 DSP=1 ./launch/run_megatron.sh`` (single process, fp32, Megatron Adam), measured;
#: the per-layout agreement with an independent oracle is pinned by test_megatron_parallel.py. Megatron's
#: log line averages the losses since the last log, and train() keeps the first iteration in that average
#: (it logs iteration 1 to show start-up cost without resetting): iteration 2 prints mean(1.600201, 1.490363).
SINGLE_PROCESS = {1: 1.600201, 2: 1.545282, 3: 1.354884}
#: the per-iteration losses of the same run (9 digits; TensorBoard's ``loss`` scalar)
SINGLE_PROCESS_PER_ITERATION = {1: 1.600200891, 2: 1.490362883}


def test_dsp2_launch_logs_the_single_process_losses(dsp2: tuple) -> None:
    """Megatron's own defaults, --bias-gelu-fusion included (its fused bias-GELU is the DiT's tanh GELU)."""
    losses = dsp2[0]
    assert "bias_gelu_fusion ................................ True" in dsp2[1]
    print(f"\nlaunch losses: DSP=2 {losses}, single process (measured) {SINGLE_PROCESS}")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    assert max(abs(SINGLE_PROCESS[i] - losses[i]) for i in losses) < 2e-6, losses


def test_fp8_switch_flag_through_pretrain_keeps_the_loss_curve() -> None:
    """``--dsp-comm-dtype fp8`` on the launch's command line, parsed by Megatron's own parser (the extra-args
    hook) and carried by ``pretrain()`` to every switch: the loss stays within 1% of the single process at every
    iteration, and is not the fp32 wire's (the payload is in use). Measured: 1.600471, 1.545073, 1.354415."""
    losses, out = launch("--dsp-comm-dtype", "fp8", NPROC="2", DSP="2")
    print(f"\nlaunch losses with the FP8 wire: {losses}, single process (measured) {SINGLE_PROCESS}")
    assert re.search(r"dsp_comm_dtype \.+ fp8", out), out[-3000:]
    assert sorted(losses) == [1, 2, 3], losses
    assert all(abs(losses[i] - SINGLE_PROCESS[i]) < 0.01 * SINGLE_PROCESS[i] for i in losses), losses
    assert max(abs(losses[i] - SINGLE_PROCESS[i]) for i in losses) > 2e-6, losses


def test_evaluation_prints_megatron_validation_loss(dsp2: tuple) -> None:
    found = VALIDATION.findall(dsp2[1])
    print(f"\nvalidation lines: {found}")
    assert ("2", "", found[0][2]) == found[0] and float(found[0][2]) > 0
    assert any(suffix for _, suffix, _ in found), "pretrain() evaluates once more after training"


def test_the_launch_logs_what_dsp_did_in_iteration_1(dsp2: tuple) -> None:
    """pretrain()'s own train() runs a wrapped train_step once counted: the groups, the all-to-alls, the bytes."""
    out = dsp2[1]
    assert "DSP: tp(1) x dsp(2) x dp(1) x pp(1) = 2" in out and "DSP groups [[0, 1]]" in out, out[-3000:]
    traffic = re.search(r"DSP step traffic \(this rank\): (\d+) all-to-alls forward, (\d+) backward", out)
    assert traffic and int(traffic.group(1)) > 0 and traffic.group(1) == traffic.group(2), out[-3000:]
    assert out.count("DSP step traffic") == 1, "only iteration 1 is counted"


def test_the_first_run_of_save_d_load_d_starts_fresh_and_says_so(dsp2: tuple) -> None:
    """The fixture's run is the first of a job using Megatron's auto-resume idiom: it trains (the losses above)
    and logs that it starts from scratch."""
    assert "is the --save directory and holds no checkpoint yet: starting from scratch" in dsp2[1]


def test_resume_at_another_dsp_size_with_more_iterations(dsp2: tuple) -> None:
    """The second run of the same ``--save D --load D`` job (at another DSP size, from iteration 2): bit-exact.
    The checkpoint was saved by a 3-iteration run; ``--train-iters 4`` changes Megatron's scheduler
    (``wd_incr_steps``), which ``run_megatron.sh`` lets the command line win (``LR_SCHEDULE``)."""
    resumed, out = launch("--save", dsp2[2], "--load", dsp2[2], "--save-interval", "2", "--ckpt-step", "2", iters=4,
                          NPROC="4", DSP="4")
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    print(f"\nDSP=2 -> DSP=4 resume, 3 -> 4 iterations: iteration 3 loss {resumed[3]!r} vs uninterrupted "
          f"{dsp2[0][3]!r}")
    assert sorted(resumed) == [3, 4]
    assert resumed[3] == dsp2[0][3]


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
