"""Training Wan through ``dsp_plugin.parallelize``: DeepSpeed ZeRO-2/3 with the DSP key, and torch DDP.

Oracle: diffusers' unmodified WanTransformer3DModel on one process, on the whole
global batch, with torch SGD (a wrong gradient scale shows up in the
parameters). 45 tokens and 3 heads on DSP=2 x DP=2: uneven token shards, uneven
heads. The DDP convention (docs/concepts.md): DDP averages over DP x DSP, so the
loss is multiplied by the DSP size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

SAMPLES, BATCH, STEPS, LR, TOL = 12, 4, 3, 0.5, 1e-5


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 4, 5, 6, 6, generator=g), torch.randint(0, 1000, (SAMPLES,), generator=g),
        torch.randn(SAMPLES, 7, 16, generator=g), torch.randn(SAMPLES, 4, 5, 6, 6, generator=g))


def loss_fn(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    latents, timestep, text, target = batch
    return torch.nn.functional.mse_loss(model(latents, timestep, text, return_dict=False)[0], target)


def _params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k.removeprefix("module."): p.detach().clone().numpy() for k, p in module.named_parameters()}


def reference() -> tuple[dict[str, np.ndarray], list[float]]:
    from dsp_plugin.adapters.tiny import tiny_wan
    from dsp_plugin.data import dsp_dataloader

    model = tiny_wan(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _, batch in zip(range(STEPS), dsp_dataloader(dataset(), batch_size=BATCH, shuffle=True, dp_size=1,
                                                      dp_rank=0)):
        loss = loss_fn(model, tuple(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return _params(model), losses


def _worker(rank: int, world: int, jobs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    from tests.deepspeed_harness import ds_config, full_params, setup_worker

    setup_worker(rank, world)
    import dsp_plugin
    from dsp_plugin.adapters.tiny import tiny_wan
    from dsp_plugin.comm import all_reduce_mean
    from dsp_plugin.data import dsp_dataloader
    from dsp_plugin.deepspeed import initialize
    from dsp_plugin.topology import Topology, get_topology, set_topology

    out = []
    for kind, dsp in jobs:
        model = dsp_plugin.parallelize(tiny_wan(layers=1))     # group=None: the topology's DSP group
        losses = []
        if kind == "ddp":
            topology = Topology.build(dsp=dsp)
            set_topology(topology)
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=topology.dp_dsp_group)
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            loader = dsp_dataloader(dataset(), batch_size=BATCH // topology.dp, shuffle=True)
            for _, batch in zip(range(STEPS), loader):
                loss = loss_fn(ddp, tuple(batch))
                opt.zero_grad()
                (loss * topology.dsp).backward()            # DDP averages over DP x DSP
                opt.step()
                losses.append(all_reduce_mean(loss, group=topology.dp_group).item())
            params = _params(ddp)
        else:
            stage = int(kind.removeprefix("zero"))
            dp = world // dsp
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            engine, _, loader, _ = initialize(model=model, optimizer=optimizer, training_data=dataset(),
                                              config=ds_config(stage, dsp, micro_batch=BATCH // dp,
                                                               train_batch_size=BATCH))
            for _, batch in zip(range(STEPS), loader):
                loss = loss_fn(engine, tuple(batch))
                engine.backward(loss)
                engine.step()
                losses.append(all_reduce_mean(loss, group=get_topology().dp_group).item())
            params = full_params(engine)
        out.append({"kind": kind, "dsp": dsp, "losses": losses, "params": params})
    return out


@pytest.mark.slow
def test_wan_training_matches_single_process() -> None:
    from dsp_plugin.adapters.tiny import tiny_wan

    expected_params, expected_losses = reference()
    initial = _params(tiny_wan(layers=1))
    assert max(float(np.abs(expected_params[k] - initial[k]).max()) for k in initial) > 1e-2  # it trains
    results = run_distributed(_worker, 4, [("zero2", 2), ("zero3", 2), ("ddp", 2)], timeout=600)
    for rank, runs in enumerate(results):
        for run in runs:
            name = f"rank {rank} {run['kind']} dsp={run['dsp']}"
            loss_diff = max(abs(a - b) for a, b in zip(run["losses"], expected_losses))
            assert len(run["losses"]) == STEPS, name
            assert loss_diff < TOL, f"{name}: losses {run['losses']} vs {expected_losses}"
            assert run["params"].keys() == expected_params.keys(), name
            diff = max(float(np.abs(run["params"][k] - expected_params[k]).max()) for k in expected_params)
            print(f"{name}: max |param diff| {diff:.3g}, max |loss diff| {loss_diff:.3g}")
            assert diff < TOL, f"{name}: parameters differ by {diff:.3g}"
