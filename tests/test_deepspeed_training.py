"""Training through ``dsp_plugin.deepspeed.initialize`` end to end: loss curves and checkpoints.

Done-when of the DeepSpeed issue: with the key and ZeRO-2 / ZeRO-3 on 4 CPU
ranks (DSP=2 x DP=2), the loss curve of AdamW training on data served by the
returned ``dsp_dataloader`` equals the single-process one. A run resumed from
an engine checkpoint (with the loader's state as client state) continues that
curve, at the same and at a different DSP size (DSP=4 x DP=1; parameters are
replicated across DSP and ZeRO partitions over DP x DSP = the same 4 ranks).

Two spawned runs in all: the first trains both stages uninterrupted and
writes the checkpoints, the second resumes from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.deepspeed_harness import LATENT, TEXT, ds_config, dsp_model, loss_fn, make_model, setup_worker

SAMPLES = 16
TRAIN_BATCH = 4          # global; DeepSpeed derives micro = 4 / (gas * DP)
GAS = 2
STEPS = 4
SAVE_AT = 2
LR = 1e-3
ADAMW = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                     "torch_adam": True}}
CLIP = 1.0               # DeepSpeed's default, on in both runs: the norm must be global over DP x DSP
TOL = 1e-5


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, *LATENT, generator=g), torch.randint(0, 1000, (SAMPLES,), generator=g),
        torch.randn(SAMPLES, *TEXT, generator=g), torch.randn(SAMPLES, *LATENT, generator=g))


def reference_curve() -> list[float]:
    """Single process, the same samples per step (the DSP sampler at DP=1), torch AdamW."""
    from dsp_plugin.data import dsp_dataloader

    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loader = dsp_dataloader(dataset(), batch_size=TRAIN_BATCH, shuffle=True, dp_size=1, dp_rank=0)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        loss = loss_fn(model, tuple(batch))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def train_worker(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each job: ``stage``, ``dsp``, ``steps``; optional ``load`` / ``save`` (dir, tag) and ``save_at``."""
    setup_worker(rank, world_size)
    from dsp_plugin.deepspeed import initialize
    from dsp_plugin.topology import get_topology

    out = []
    for job in jobs:
        model = dsp_model()
        config = ds_config(job["stage"], job["dsp"], micro_batch=TRAIN_BATCH // (GAS * world_size // job["dsp"]),
                           gas=GAS, clip=CLIP, train_batch_size=TRAIN_BATCH, optimizer=ADAMW)
        del config["zero_allow_untested_optimizer"]
        engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(),
                                          training_data=dataset(), config=config)
        if "load" in job:
            _, client = engine.load_checkpoint(job["load"], tag="resume")
            loader.load_state_dict(client["loader"])
        batches = iter(loader)
        losses = []
        for step in range(job["steps"]):
            micro = []
            for _ in range(GAS):
                loss = loss_fn(engine, tuple(next(batches)))
                engine.backward(loss)
                engine.step()
                micro.append(loss.item())
            losses.append(sum(micro) / GAS)
            if job.get("save_at") == step + 1:
                engine.save_checkpoint(job["save"], tag="resume", client_state={"loader": loader.state_dict()})
        coords = get_topology().coords()
        out.append({"losses": losses, "dp_rank": coords["dp"], "dsp_rank": coords["dsp"]})
        engine.destroy()
    return out


def global_curve(per_rank: list[dict[str, Any]]) -> list[float]:
    """Mean over DP ranks of the local losses (every rank of a DSP group must report the same)."""
    by_dp: dict[int, list[float]] = {}
    for r in per_rank:
        seen = by_dp.setdefault(r["dp_rank"], r["losses"])
        assert max(abs(a - b) for a, b in zip(seen, r["losses"])) < 1e-6, "DSP ranks disagree on the loss"
    curves = list(by_dp.values())
    return [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]


@pytest.mark.slow
def test_zero2_zero3_loss_curves_and_resume(tmp_path: Path) -> None:
    reference = reference_curve()
    assert reference[-1] < reference[0], "the reference loss should fall"
    ckpt = {stage: str(tmp_path / f"zero{stage}") for stage in (2, 3)}
    full = run_distributed(train_worker, 4, [
        {"stage": stage, "dsp": 2, "steps": STEPS, "save": ckpt[stage], "save_at": SAVE_AT} for stage in (2, 3)
    ], timeout=600)
    for i, stage in enumerate((2, 3)):
        curve = global_curve([r[i] for r in full])
        diff = max(abs(a - b) for a, b in zip(curve, reference))
        assert diff < TOL, f"ZeRO-{stage} DSP=2 x DP=2: loss curve {curve} vs single process {reference}"

    resumed_jobs = [(2, 2), (2, 4), (3, 4)]  # (stage, DSP size) of the resumed run
    resumed = run_distributed(train_worker, 4, [
        {"stage": stage, "dsp": dsp, "steps": STEPS - SAVE_AT, "load": ckpt[stage]} for stage, dsp in resumed_jobs
    ], timeout=600)
    for i, (stage, dsp) in enumerate(resumed_jobs):
        curve = global_curve([r[i] for r in resumed])
        diff = max(abs(a - b) for a, b in zip(curve, reference[SAVE_AT:]))
        assert diff < TOL, (f"ZeRO-{stage} resumed at DSP={dsp}: {curve} vs uninterrupted "
                            f"{reference[SAVE_AT:]}")
