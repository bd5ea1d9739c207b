"""DSP x DP: gradients after reduction equal the single-process gradient of the global batch.

Two reductions are pinned here (design.md §3):
- ``reduce_gradients``: sum over DP x DSP, divide by DP.
- torch ``DistributedDataParallel`` over the DP x DSP group: it averages over DP * DSP
  ranks, so the loss is multiplied by the DSP size (as Megatron does for context parallelism).
"""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel

from dsp_plugin import Topology, parallelize, reduce_gradients, set_topology
from dsp_plugin.models import STDiT, STDiTConfig
from tests.distributed import run_distributed

SHAPE = (4, 4, 6, 6, 6)        # global batch of 4: two samples per DP rank; T=6, S=9


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(SHAPE, generator=g), torch.randint(0, 1000, (SHAPE[0],), generator=g),
            torch.randn(SHAPE[0], 3, 16, generator=g), torch.randn(SHAPE, generator=g))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): p.grad.clone() for k, p in model.named_parameters()}


def _dsp_dp(rank: int, n: int) -> dict[str, float]:
    topo = Topology.build(dsp=2)                # 4 ranks: dsp 2 x dp 2
    set_topology(topo)
    latents, timestep, text, target = _batch()
    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny"))
    torch.nn.functional.mse_loss(reference(latents, timestep, text), target).backward()
    expected = _grads(reference)

    dp_rank = topo.coords()["dp"]
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)  # this DP rank's half of the global batch
    local = (latents[mine], timestep[mine], text[mine])

    model = parallelize(copy.deepcopy(reference))
    model.zero_grad()
    torch.nn.functional.mse_loss(model(*local), target[mine]).backward()
    reduce_gradients(model.parameters())
    ours = max((g - expected[k]).abs().max().item() for k, g in _grads(model).items())

    ddp = DistributedDataParallel(parallelize(copy.deepcopy(reference)),
                                  process_group=topo.dp_dsp_group)
    (torch.nn.functional.mse_loss(ddp(*local), target[mine]) * topo.dsp).backward()
    ddp_diff = max((g - expected[k]).abs().max().item() for k, g in _grads(ddp).items())

    # without the DSP factor DDP's average is off by exactly 1/DSP
    ddp_plain = DistributedDataParallel(parallelize(copy.deepcopy(reference)), process_group=topo.dp_dsp_group)
    ddp_plain.zero_grad()
    torch.nn.functional.mse_loss(ddp_plain(*local), target[mine]).backward()
    ratio = max((g * topo.dsp - expected[k]).abs().max().item() for k, g in _grads(ddp_plain).items())
    return {"reduce_gradients": ours, "ddp_scaled": ddp_diff, "ddp_unscaled_times_dsp": ratio}


def test_gradients_match_single_process_for_dsp2_dp2() -> None:
    for rank, d in enumerate(run_distributed(_dsp_dp, 4)):
        for key, value in d.items():
            assert value < 1e-5, f"rank {rank}: {key} differs by {value:.3g}"
