"""DeepSpeed + DSP against plain PyTorch in one process: gradients, parameters and losses.

The model is ``tests/deepspeed_models.py``'s video transformer (torch only), made
DSP-aware by its own forward; the oracle trains the plain model on each step's
whole batch with a torch optimizer, no DeepSpeed and no dsp_plugin. Lengths are
uneven (T=5, S=3 at DSP=2). Checked per job, on every rank:

- the reduced gradient of the first optimizer step (``safe_get_full_grad``, after
  the accumulation boundary, before the step) against the oracle's;
- the parameters after the last step (the optimizer's fp32 master copy) and the
  loss per step;
- the parameters' dtype after ``initialize`` (bf16 jobs).

A model built under ``zero.Init()`` is compared from its own initial parameters
(read back after ``initialize``): in bf16, torch draws other initial values.

fp32 jobs cover gradient accumulation (2 micro-batches), clipping that acts (at
half the first step's gradient norm), ZeRO-Offload of the optimizer (ZeRO-2) and
of parameters and optimizer (ZeRO-3) and a model built under ``zero.Init()``;
bf16 jobs cover ZeRO 0-3. SGD throughout: Adam's normalisation would hide a
wrong scale. A control job trains the plain model (never sharded) with the guard
off and must come out at exactly DSP times the gradient: proof the checks can
fail. The tolerances are stated next to each check; a gradient off by
the DSP factor (2x) fails every one of them. fp16: DeepSpeed's CPU accelerator
refuses it ("Type fp16 is not supported on your device": no mkldnn fp16 on this
CPU), so fp16 is left to a GPU run; the ZeRO-3 cast it needs is the bf16 one.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest

from tests.deepspeed_harness import full_params, setup_worker
from tests.deepspeed_models import local_micro, make_dsp, make_plain, reference_steps

DSP = 2
MB = 1
STEPS = 2
LR = 0.5
FP32_TOL = 2e-5          # max abs, gradients and parameters
BF16_REL = 0.05          # max abs error / max abs of the reference gradient or parameter update
BF16_LOSS_REL = 0.02     # per-step loss, relative
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_ALL = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def _config(job: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": job["stage"], **job.get("zero", {})}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": job["gas"],
        "sequence_parallel_mode": "dsp", "sequence_parallel_size": DSP, "gradient_clipping": job.get("clip", 0.0),
        "zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9}
    if job["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def gradient_worker(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train each job for ``STEPS`` optimizer steps; return grads of step 0, final params, losses, dtypes."""
    setup_worker(rank, world_size)
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.utils import safe_get_full_grad

    from dsp_plugin.deepspeed import GUARD_ENV, initialize, skip_cpu_shm_build
    from dsp_plugin.topology import get_topology

    out = []
    for job in jobs:
        config = _config(job)
        os.environ[GUARD_ENV] = "0" if job.get("unsharded") else "1"
        if job.get("unsharded"):  # the control: the plain model, never sharded, guard off
            model = make_plain()
        elif job.get("zero_init"):
            skip_cpu_shm_build()
            deepspeed.init_distributed(dist_backend="gloo")
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = make_dsp()
        else:
            model = make_dsp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = initialize(model=model, optimizer=opt, config=config)
        initial = full_params(engine) if job.get("zero_init") else None
        dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
        topo = get_topology()
        dp, dp_rank = topo.dp, topo.coords()["dp"]
        grads, losses = {}, []
        for step in range(STEPS):
            micro_losses = []
            for micro in range(job["gas"]):
                x, y = local_micro(step, micro, dp=dp, dp_rank=dp_rank, gas=job["gas"], mb=MB)
                if job["precision"] == "bf16":
                    x = x.bfloat16()
                loss = F.mse_loss(engine(x).float(), y)
                engine.backward(loss)
                if step == 0 and micro == job["gas"] - 1:
                    grads = {n: safe_get_full_grad(p).detach().float().clone().numpy()
                             for n, p in engine.module.named_parameters()}
                engine.step()
                micro_losses.append(loss.item())
            losses.append(sum(micro_losses) / job["gas"])
        params = full_params(engine)
        out.append({"grads": grads, "params": params, "losses": losses, "dtypes": dtypes, "dp_rank": dp_rank,
                    "initial": initial})
        engine.destroy()
    return out


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray], scale: dict[str, np.ndarray]) -> float:
    """max |a - b| over all parameters, relative to max |scale|."""
    return max(float(np.abs(a[k] - b[k]).max()) for k in b) / max(float(np.abs(scale[k]).max()) for k in b)


def _abs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


def _projection(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """<a, b> / <b, b>: 1.0 when a == b, 2.0 for twice the gradient, 0.5 for half."""
    return sum(float(np.sum(a[k] * b[k])) for k in b) / sum(float(np.sum(b[k] ** 2)) for k in b)


def measure(world_size: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``world_size`` ranks; per job the worst rank's differences from the oracle."""
    from tests.distributed import run_distributed

    dp = world_size // DSP
    runs = run_distributed(gradient_worker, world_size, jobs, timeout=900)
    rows = []
    for i, job in enumerate(jobs):
        per_rank = [run[i] for run in runs]
        ref = reference_steps(STEPS, dp=dp, gas=job["gas"], mb=MB, lr=LR, clip=job.get("clip", 0.0),
                              initial=per_rank[0]["initial"])
        update = {k: ref["params"][k] - ref["initial"][k] for k in ref["params"]}
        by_dp = {r["dp_rank"]: r["losses"] for r in per_rank}  # DSP ranks of a group report the same loss
        curve = [sum(c[k] for c in by_dp.values()) / dp for k in range(STEPS)]
        rows.append({
            "job": job, "dtypes": per_rank[0]["dtypes"],
            "grad_abs": max(_abs(r["grads"], ref["grads"]) for r in per_rank),
            "grad_rel": max(_rel(r["grads"], ref["grads"], ref["grads"]) for r in per_rank),
            "grad_ratio": _projection(per_rank[0]["grads"], ref["grads"]),
            "param_abs": max(_abs(r["params"], ref["params"]) for r in per_rank),
            "param_rel": max(_rel(r["params"], ref["params"], update) for r in per_rank),
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(curve, ref["losses"])),
        })
    return rows


def _check(rows: list[dict[str, Any]], world_size: int) -> None:
    for row in rows:
        job = row["job"]
        if job.get("unsharded"):
            # The control: DSP ranks each compute the whole gradient and ZeRO sums them.
            assert math.isclose(row["grad_ratio"], DSP, rel_tol=0.01), f"control: {row['grad_ratio']:.3f}x"
            continue
        where = f"{job['precision']} ZeRO-{job['stage']} {job} on {world_size} ranks"
        if job["precision"] == "fp32":
            assert row["grad_abs"] < FP32_TOL, f"{where}: gradient differs by {row['grad_abs']:.3g} " \
                                               f"({row['grad_ratio']:.3f}x the single-process one)"
            assert row["param_abs"] < FP32_TOL, f"{where}: parameters differ by {row['param_abs']:.3g}"
            assert row["loss_rel"] < 1e-5, f"{where}: loss differs by {row['loss_rel']:.3g} (relative)"
        else:
            assert row["dtypes"] == ["torch.bfloat16"], f"{where}: parameters are {row['dtypes']} after initialize"
            assert row["grad_rel"] < BF16_REL, f"{where}: gradient off by {row['grad_rel']:.3g} of its max " \
                                               f"({row['grad_ratio']:.3f}x the single-process one)"
            assert row["param_rel"] < BF16_REL, f"{where}: parameters off by {row['param_rel']:.3g} of the update"
            assert row["loss_rel"] < BF16_LOSS_REL, f"{where}: loss off by {row['loss_rel']:.3g} (relative)"
        assert math.isclose(row["grad_ratio"], 1.0, abs_tol=0.02), f"{where}: gradient {row['grad_ratio']:.3f}x"


def _clip_that_acts(world_size: int, gas: int) -> float:
    """Half the oracle's first-step gradient norm, so clipping changes the step."""
    ref = reference_steps(1, dp=world_size // DSP, gas=gas, mb=MB, lr=LR)
    return 0.5 * math.sqrt(sum(float(np.sum(g ** 2)) for g in ref["grads"].values()))


def jobs_for(world_size: int) -> list[dict[str, Any]]:
    clip = _clip_that_acts(world_size, 2)
    fp32 = [
        {"precision": "fp32", "stage": 0, "gas": 2, "clip": clip},
        {"precision": "fp32", "stage": 1, "gas": 2, "clip": clip},
        {"precision": "fp32", "stage": 2, "gas": 2, "clip": clip, "zero": OFFLOAD},
        {"precision": "fp32", "stage": 3, "gas": 2, "clip": clip, "zero": OFFLOAD_ALL, "zero_init": True},
    ]
    bf16 = [{"precision": "bf16", "stage": stage, "gas": 1} for stage in (0, 1, 2, 3)]
    if world_size == 4:
        return fp32 + bf16
    return bf16 + [{"precision": "bf16", "stage": 3, "gas": 1, "zero_init": True},
                   {"precision": "fp32", "stage": 3, "gas": 1, "zero_init": True},
                   {"precision": "fp32", "stage": 2, "gas": 1, "unsharded": True}]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_match_plain_pytorch(world_size: int) -> None:
    """DSP=2 (2 ranks) and DSP=2 x DP=2 (4 ranks)."""
    _check(measure(world_size, jobs_for(world_size)), world_size)


def test_a_second_gradient_scale_replaces_the_first_and_scale_one_removes_it() -> None:
    """A second ``initialize`` on the same module installs the ZeRO-3 scale again: it must replace the
    hooks, not stack them (gradients DSP^2 times too large); scale 1 leaves no hook at all."""
    import torch

    from dsp_plugin.deepspeed.gradients import install_gradient_scale

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)

    def grads() -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        layer(x).square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    plain = grads()
    install_gradient_scale(layer, 2.0)
    install_gradient_scale(layer, 2.0)              # a second initialize on the same module
    for got, want in zip(grads(), plain, strict=True):
        ratio = (got.abs().sum() / want.abs().sum()).item()
        assert torch.allclose(got, 2 * want), \
            f"two install_gradient_scale(2) calls scale gradients by {ratio:g}, expected 2: the hooks stacked"
    assert install_gradient_scale(layer, 1.0) == []
    for got, want in zip(grads(), plain, strict=True):
        ratio = (got.abs().sum() / want.abs().sum()).item()
        assert torch.equal(got, want), f"after install_gradient_scale(1) gradients are scaled by {ratio:g}, " \
            "expected 1: scale 1 must remove the hooks"


if __name__ == "__main__":
    print("| ranks | precision | ZeRO | job | grad max abs | grad max rel | grad ratio | param max abs "
          "| param rel to update | loss rel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ws in (2, 4):
        for row in measure(ws, jobs_for(ws)):
            job = row["job"]
            extra = ", ".join(f"{k}={v}" for k, v in job.items() if k not in ("precision", "stage"))
            print(f"| {ws} | {job['precision']} | {job['stage']} | {extra} | {row['grad_abs']:.2e} "
                  f"| {row['grad_rel']:.2e} | {row['grad_ratio']:.4f} | {row['param_abs']:.2e} "
                  f"| {row['param_rel']:.2e} | {row['loss_rel']:.2e} |", flush=True)
