"""Sampling Wan with the latents sharded on frames from the first step to the last (``sharded_io``).

Oracle: the same loop (diffusers' FlowMatchEulerDiscreteScheduler, deterministic)
on the unmodified WanTransformer3DModel on one process. The latents are split
once before step 0 and gathered once after the last step; between them every
step runs the transformer on this rank's frames and the scheduler on the shard:
all-to-alls only (two per layer), no all_gather. 5 frames on 2 and 4 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

STEPS, LAYERS = 4, 2


def _loop(model: torch.nn.Module, latents: torch.Tensor, text: torch.Tensor, **io: int) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from dsp_plugin.plan import sharded_io

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(STEPS)
    for t in scheduler.timesteps:
        with torch.no_grad():
            if io:
                with sharded_io(**io):
                    noise = model(latents, t[None], text, return_dict=False)[0]
            else:
                noise = model(latents, t[None], text, return_dict=False)[0]
        latents = scheduler.step(noise, t, latents, return_dict=False)[0]
    return latents


def _worker(rank: int, n: int) -> dict[str, float]:
    import dsp_plugin
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import gather, split
    from dsp_plugin.testing.tiny import tiny_wan

    reference = tiny_wan(layers=LAYERS)
    g = torch.Generator().manual_seed(2)
    noise, text = torch.randn(1, 4, 5, 6, 6, generator=g), torch.randn(1, 7, 16, generator=g)
    expected = _loop(reference, noise, text)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    shard = split(noise, 2)                                            # once, before step 0
    with CommAccounting(activations=False) as acct:
        shard = _loop(model, shard, text, F=5, HW=9)
    video = gather(shard, 2, global_len=5)                              # once, after the last step
    return {"diff": (video - expected).abs().max().item(), "local_frames": shard.shape[2],
            "all_to_all": acct.count("all_to_all"), "all_gather": acct.count("all_gather")}


@pytest.mark.parametrize("n", [2, 4])
def test_wan_sampling_sharded_first_to_last_step(n: int) -> None:
    for rank, d in enumerate(run_distributed(_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        assert d["diff"] < 1e-5, d
        assert d["local_frames"] == [2, 1, 1, 1][rank] if n == 4 else [3, 2][rank], d
        assert d["all_to_all"] == 2 * LAYERS * STEPS and d["all_gather"] == 0, d
