"""ZeRO 0/1/2/3 with the DSP key give the single-process parameters: one convention, pinned per stage.

Each DSP rank holds a partial gradient (its shard's contribution); the right
gradient is the SUM over DSP and the MEAN over DP. DeepSpeed 0.19 given our mpu
gets stages 0-2 right by itself and averages over DP x DSP in stage 3's
reduce-scatter; ``dsp_plugin.deepspeed.gradients`` scales stage 3 by the DSP
size. SGD, not Adam: Adam would hide a wrong gradient scale.

One spawned run per world size trains all four stages in turn (spawning and
importing DeepSpeed is the main cost). ``python -m tests.test_deepspeed_convention``
prints the measured table for the docs: with the plugin's scale, without it
(``raw``), and with DeepSpeed's own mesh keys instead of the DSP key (``mesh``).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.distributed import run_distributed
from tests.deepspeed_harness import (
    TOL,
    ds_config,
    dsp_model,
    full_params,
    global_batch,
    loss_fn,
    make_model,
    max_diff,
    reference_run,
    setup_worker,
    update_ratio,
)

STAGES = (0, 1, 2, 3)
STEPS = 2
LR = 0.5
MICRO_BATCH = 1


def _train(engine: Any, dp: int, dp_rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        batch = global_batch(step, MICRO_BATCH * dp)
        mine = tuple(t[dp_rank * MICRO_BATCH:(dp_rank + 1) * MICRO_BATCH] for t in batch)
        loss = loss_fn(engine, mine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def convention_worker(rank: int, world_size: int, dsp: int, stages: tuple[int, ...], steps: int,
                      mode: str = "plugin") -> dict[int, dict[str, Any]]:
    """Train ``steps`` SGD steps per ZeRO stage; return each stage's full parameters and losses.

    mode ``plugin``: ``dsp_plugin.deepspeed.initialize``; ``raw``: the same
    mpu and groups but neither correction (DeepSpeed alone); ``partitioned``:
    ZeRO-3 partitioned over DP x DSP, no gradient scale; ``mesh``: DeepSpeed's
    own ``sequence_parallel_size`` + ``data_parallel_size`` keys, no DSP key.
    """
    setup_worker(rank, world_size)
    import deepspeed
    import torch
    import torch.distributed as dist

    from dsp_plugin.deepspeed import initialize, load_config, parse_dsp_config
    from dsp_plugin.deepspeed.engine import _initialize_dsp, skip_cpu_shm_build
    from dsp_plugin.topology import Topology, get_topology, set_topology

    results: dict[int, dict[str, Any]] = {}
    for stage in stages:
        model = dsp_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        config = ds_config(stage, dsp, micro_batch=MICRO_BATCH)
        if mode == "plugin":
            engine, *_ = initialize(model=model, optimizer=opt, config=config)
            dp, dp_rank = get_topology().dp, get_topology().coords()["dp"]
        elif mode in ("raw", "partitioned"):
            skip_cpu_shm_build()
            settings = parse_dsp_config(load_config(config=config), world_size=world_size)
            engine, *_ = _initialize_dsp(settings, training_data=None, scale=1.0,
                                         zero3_partition=mode == "partitioned", args=None, model=model,
                                         optimizer=opt, model_parameters=None, lr_scheduler=None,
                                         distributed_port=29500, dist_init_required=None, collate_fn=None,
                                         config=config, config_params=None)
            dp, dp_rank = get_topology().dp, get_topology().coords()["dp"]
        else:
            skip_cpu_shm_build()
            del config["sequence_parallel_mode"]
            dp = world_size // dsp
            config["data_parallel_size"] = dp
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            from deepspeed.utils import groups

            dp_rank = dist.get_rank(groups._get_data_parallel_group())
            # The model's split/gather run on DeepSpeed's sequence-parallel group.
            set_topology(Topology(tp=1, dsp=dsp, dp=dp, pp=1, rank=rank, world_size=world_size,
                                  dsp_group=groups._get_sequence_parallel_group()))
        losses = _train(engine, dp, dp_rank, steps)
        results[stage] = {"params": full_params(engine), "losses": losses}
        engine.destroy()
    return results


def _measure(world_size: int, dsp: int, steps: int, mode: str = "plugin") -> dict[int, dict[str, Any]]:
    """Per stage: max |param - reference| over ranks, update ratio, spread between ranks."""
    dp = world_size // dsp
    reference, _ = reference_run(steps, MICRO_BATCH * dp, lr=LR)
    initial = {n: p.detach().numpy() for n, p in make_model().named_parameters()}
    runs = run_distributed(convention_worker, world_size, dsp, STAGES, steps, mode, timeout=600)
    table = {}
    for stage in STAGES:
        per_rank = [run[stage]["params"] for run in runs]
        table[stage] = {
            "max_diff": max(max_diff(p, reference) for p in per_rank),
            "ratio": update_ratio(per_rank[0], initial, reference),
            "rank_spread": max(max_diff(p, per_rank[0]) for p in per_rank),
        }
    return table


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2])
def test_every_zero_stage_matches_single_process(world_size: int) -> None:
    """DSP=2 (2 ranks): STDiT parameters after two SGD steps, every stage.

    DSP=2 x DP=2 is pinned for every stage against plain PyTorch by
    ``tests/test_deepspeed_gradients.py``; ``python -m tests.test_deepspeed_convention``
    still measures both world sizes for the table in docs/deepspeed.md.
    """
    table = _measure(world_size, dsp=2, steps=STEPS)
    for stage, row in table.items():
        assert row["max_diff"] < TOL, (
            f"ZeRO-{stage}, world {world_size}, DSP=2: parameters differ from the single-process run by "
            f"{row['max_diff']:.3g} (update {row['ratio']:.3f}x the reference's)")


if __name__ == "__main__":
    modes = sys.argv[1:] or ["plugin", "raw", "partitioned", "mesh"]
    print("| mode | ranks | DSP x DP | ZeRO | max abs(param - single process) | update / reference | rank spread |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        for world_size in (2, 4):
            for stage, row in _measure(world_size, 2, 1, mode).items():
                print(f"| {mode} | {world_size} | 2 x {world_size // 2} | {stage} | {row['max_diff']:.2e} "
                      f"| {row['ratio']:.3f} | {row['rank_spread']:.2e} |", flush=True)
