"""Training the Latte adapter: DeepSpeed ZeRO-2/3 with the DSP key, and plain torch DDP over DP x DSP.

Oracle: diffusers' unmodified LatteTransformer3DModel on one process, on the
whole global batch, with torch SGD (SGD, not Adam: a wrong gradient scale shows
up in the parameters). 7 frames: uneven on DSP=2 (4+3) and DSP=4 (2+2+2+1).
The DDP convention (docs/concepts.md): DDP averages over DP x DSP, so the loss
is multiplied by the DSP size.
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
        torch.randn(SAMPLES, 4, 7, 8, 8, generator=g), torch.randint(0, 1000, (SAMPLES,), generator=g),
        torch.randn(SAMPLES, 5, 16, generator=g), torch.randn(SAMPLES, 8, 7, 8, 8, generator=g))


def loss_fn(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    latents, timestep, text, target = batch
    out = model(latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    return torch.nn.functional.mse_loss(out, target)


def _params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k.removeprefix("module.").removeprefix("model."): p.detach().clone().numpy()
            for k, p in module.named_parameters()}


def reference() -> tuple[dict[str, np.ndarray], list[float]]:
    from dsp_plugin.adapters.tiny import tiny_latte
    from dsp_plugin.data import dsp_dataloader

    model = tiny_latte(layers=1)
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
    from dsp_plugin.adapters.latte import LatteDSP
    from dsp_plugin.adapters.tiny import tiny_latte
    from dsp_plugin.comm import all_reduce_mean
    from dsp_plugin.data import dsp_dataloader
    from dsp_plugin.deepspeed import initialize
    from dsp_plugin.topology import Topology, get_topology, set_topology

    out = []
    for kind, dsp in jobs:
        adapter = LatteDSP(tiny_latte(layers=1))          # group=None: the topology's DSP group
        losses = []
        if kind == "ddp":
            topology = Topology.build(dsp=dsp)
            set_topology(topology)
            model = torch.nn.parallel.DistributedDataParallel(adapter, process_group=topology.dp_dsp_group)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            loader = dsp_dataloader(dataset(), batch_size=BATCH // topology.dp, shuffle=True)
            for _, batch in zip(range(STEPS), loader):
                loss = loss_fn(model, tuple(batch))
                opt.zero_grad()
                (loss * topology.dsp).backward()            # DDP averages over DP x DSP
                opt.step()
                losses.append(all_reduce_mean(loss, group=topology.dp_group).item())
            params = _params(model)
        else:
            stage = int(kind.removeprefix("zero"))
            dp = world // dsp
            optimizer = torch.optim.SGD(adapter.parameters(), lr=LR)
            engine, _, loader, _ = initialize(model=adapter, optimizer=optimizer, training_data=dataset(),
                                              config=ds_config(stage, dsp, micro_batch=BATCH // dp,
                                                               train_batch_size=BATCH))
            for _, batch in zip(range(STEPS), loader):
                loss = loss_fn(engine, tuple(batch))
                engine.backward(loss)
                engine.step()
                losses.append(all_reduce_mean(loss, group=get_topology().dp_group).item())
            params = {k.removeprefix("model."): v for k, v in full_params(engine).items()}
        out.append({"kind": kind, "dsp": dsp, "losses": losses, "params": params})
    return out


@pytest.mark.slow
def test_latte_training_matches_single_process() -> None:
    from dsp_plugin.adapters.tiny import tiny_latte

    expected_params, expected_losses = reference()
    initial = _params(tiny_latte(layers=1))
    assert len(expected_losses) == STEPS
    assert max(float(np.abs(expected_params[k] - initial[k]).max()) for k in initial) > 1e-2  # it trains
    jobs = [("zero2", 2), ("zero3", 2), ("zero2", 4), ("zero3", 4), ("ddp", 2), ("ddp", 4)]
    results = run_distributed(_worker, 4, jobs, timeout=600)
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
