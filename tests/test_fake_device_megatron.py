"""megatron.training on a fake GPU node, as local rank 1: the model as ``pretrain()`` builds it, and its forward.

The arguments are the ones ``launch/run_megatron.sh`` passes on a GPU node (its
``python`` replaced by a stub that records them: NCCL, ``--bf16``), less
``--use-cpu-initialization``, so megatron-core creates every parameter on the
current GPU as ``pretrain()`` does by default; plus megatron.training's own
``--fake-process-group`` and ``--skip-train`` with one validation batch:
``pretrain()`` then initialises (``torch.cuda.set_device(LOCAL_RANK)``, the
model-parallel groups with DSP in the context-parallel slot), builds the model
through the launch's ``model_provider`` (``get_model``: ``.cuda()``,
``Float16Module``), builds the data iterators and runs ``evaluate()``: the
forward of ``forward_step`` and ``loss_func`` under ``torch.no_grad()``. No
training step: Megatron's DDP wraps the model by reaching into autograd's graph
(``grad_fn.next_functions``), which needs a GPU context (``docs/gpu.md``).

Beside it, the script's other side of that probe: ``CUDA_VISIBLE_DEVICES=`` takes gloo without asking.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fake_cuda import fake_cuda_node

pytest.importorskip("megatron.training")

ROOT = Path(__file__).resolve().parents[1]


def launch_args(tmp: Path, **knobs: str) -> tuple[list[str], bool]:
    """What ``launch/run_megatron.sh`` passes ``pretrain_stdit`` where its CUDA probe answers "available", and
    whether the script asked the probe. ``knobs``: the script's environment variables (CUDA_VISIBLE_DEVICES too)."""
    stub, out, asked = tmp / "python", tmp / "args.txt", tmp / "probe_asked"
    # `python -c ...` is the script's CUDA probe (answer: available); anything else is the torchrun line
    stub.write_text('#!/bin/sh\nif [ "$1" = -c ]; then touch "$PROBE_ASKED"; exit 0; fi\n'
                    'printf "%s\\n" "$@" > "$ARGS_OUT"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"PYTHON": str(stub), "ARGS_OUT": str(out), "PROBE_ASKED": str(asked), "MASTER_PORT": "29500", **knobs}
    subprocess.run(["bash", str(ROOT / "launch/run_megatron.sh")], cwd=ROOT, env=env, check=True, timeout=60)
    argv = out.read_text().splitlines()
    start = argv.index("dsp_plugin.launch.pretrain_stdit") + 1
    assert argv[start - 2] == "-m"
    return argv[start:], asked.exists()


def gpu_launch_args(tmp: Path, **knobs: str) -> list[str]:
    """What ``launch/run_megatron.sh`` passes ``pretrain_stdit`` on a node where CUDA is available."""
    argv, asked = launch_args(tmp, **knobs)
    assert asked and "--bf16" in argv and argv[argv.index("--distributed-backend") + 1] == "nccl"
    return argv


def test_an_empty_cuda_visible_devices_takes_the_cpu_path_without_the_probe(tmp_path: Path) -> None:
    """``CUDA_VISIBLE_DEVICES=`` (set, empty) hides every GPU, so the script takes gloo and fp32 without asking a
    python that imports torch (the probe would answer "available" here); unset, it asks (``gpu_launch_args``)."""
    argv, asked = launch_args(tmp_path, CUDA_VISIBLE_DEVICES="", NPROC="2", DSP="2")
    assert not asked and "--bf16" not in argv and argv[argv.index("--distributed-backend") + 1] == "gloo", argv


@pytest.fixture
def megatron_globals() -> Iterator[None]:
    """megatron.training keeps its arguments, timers, microbatch calculator and groups in globals: reset them."""
    yield
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.global_vars import destroy_global_vars

    from dsp_plugin.topology import set_topology

    ps.destroy_model_parallel()
    destroy_global_vars()
    destroy_num_microbatches_calculator()
    destroy_rerun_state_machine()
    set_topology(None)


@pytest.mark.parametrize("knobs", [{"NPROC": "2", "DSP": "2"}, {"NPROC": "4", "TP": "2", "DSP": "2"}],
                         ids=["dsp2", "tp2-dsp2"])
def test_pretrain_builds_and_evaluates_on_the_local_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         megatron_globals: None, knobs: dict[str, str]) -> None:
    from megatron.training import training

    from dsp_plugin.launch import pretrain_stdit

    argv = [a for a in gpu_launch_args(tmp_path, EVAL_ITERS="1", **knobs) if a != "--use-cpu-initialization"]
    monkeypatch.setattr(sys, "argv", ["pretrain_stdit", *argv, "--fake-process-group", "--skip-train"])
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")       # what run_megatron.sh exports
    seen: dict[str, Any] = {}
    evaluate = training.evaluate

    def observed(forward_step_func: Any, data_iterator: Any, model: list[torch.nn.Module], *args: Any,
                 **kwargs: Any) -> Any:
        seen["model"] = model
        seen["result"] = evaluate(forward_step_func, data_iterator, model, *args, **kwargs)
        return seen["result"]

    monkeypatch.setattr(training, "evaluate", observed)
    from megatron.core.datasets import utils

    for owner, name in ((training, "num_floating_point_operations"), (training, "load_checkpoint"),
                        (utils, "compile_helpers")):   # the launch's process-wide hooks: undone after the test
        monkeypatch.setattr(owner, name, getattr(owner, name))
    nproc = int(knobs["NPROC"])
    with fake_cuda_node(local_rank=1, world_size=nproc, devices=nproc, init_process_group=False) as node:
        pretrain_stdit.main()
        cuda1 = torch.device("cuda", 1)
        placed = {(p.device, p.dtype) for chunk in seen["model"] for p in chunk.parameters()}
        assert placed == {(cuda1, torch.bfloat16)}, f"{knobs}: parameters at {placed}"
        assert torch.cuda.current_device() == 1, "megatron.training did not bind LOCAL_RANK's GPU"
        losses, _, timelimit = seen["result"]
        assert not timelimit and losses["loss"].device == cuda1, losses
        assert node.collectives, "no collective reached the process group"
