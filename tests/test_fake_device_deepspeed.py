"""The DeepSpeed path on a fake 2-GPU node, as local rank 1: placement, the guard's device, ZeRO 0-3.

What ``launch/run_deepspeed.sh`` runs, up to the first forward: the launch's own
config (``launch/ds_config_dsp.json``: ZeRO-2, AdamW, clipping) with the stage and
precision the script's ``ZERO``/``PRECISION`` set, the tiny STDiT made DSP-aware by
``parallelize`` as ``dsp_plugin.launch.train_deepspeed`` does, through
``dsp_plugin.deepspeed.initialize`` and the loader it returns. The process is
``LOCAL_RANK=1`` with the current device left at 0 (``tests/fake_cuda.py``), so
whatever reads the device before DeepSpeed binds ``cuda:1`` is caught: a collective
on ``cuda:0`` raises NCCL's refusal, a ``cuda:0`` or CPU tensor meeting a
``cuda:1`` one raises FakeTensorMode's device mismatch. No backward (no GPU
context for autograd): see ``docs/gpu.md``.

ZeRO-3 runs as global rank 0 (still ``LOCAL_RANK=1``): before each forward
DeepSpeed compares its module trace with rank 0's by a broadcast, and a fake
process group cannot say what rank 0 sent, so as rank 1 the check would compare
against its own placeholder (-1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fake_cuda import FakeNode, fake_cuda_node

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]
CUDA1 = torch.device("cuda", 1)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def launch_config(stage: int, precision: str) -> dict[str, Any]:
    """``launch/ds_config_dsp.json`` as ``run_deepspeed.sh`` rewrites it for ``ZERO``/``PRECISION`` (2 ranks)."""
    config = json.loads((ROOT / "launch/ds_config_dsp.json").read_text())
    config["sequence_parallel_size"] = 2
    config["zero_optimization"]["stage"] = stage
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def first_forward(node: FakeNode, config: dict[str, Any], *, parallel: bool = True) -> tuple[Any, torch.Tensor]:
    """The launch up to its first forward: model, initialize, the loader's first batch, the engine's forward."""
    from deepspeed.utils import logger

    from dsp_plugin import parallelize
    from dsp_plugin.deepspeed import initialize
    from dsp_plugin.launch.train_deepspeed import synthetic_dataset
    from dsp_plugin.models import STDiT, STDiTConfig

    logger.setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = STDiT(STDiTConfig.preset("tiny"))
    model = parallelize(model) if parallel else model
    engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(), config=config,
                                      training_data=synthetic_dataset(8, 4, 4))
    latents, timestep, text, _ = (t.to(engine.device) for t in next(iter(loader)))
    dtype = next(engine.module.parameters()).dtype
    return engine, engine(latents.to(dtype), timestep, text.to(dtype))


@pytest.mark.parametrize(("stage", "precision", "rank"), [
    (0, "fp32", 1), (1, "bf16", 1), (2, "fp32", 1), (2, "fp16", 1), (3, "bf16", 0), (3, "fp32", 0)])
def test_first_forward_on_the_local_gpu(stage: int, precision: str, rank: int) -> None:
    with fake_cuda_node(local_rank=1, rank=rank) as node:
        engine, out = first_forward(node, launch_config(stage, precision))
        assert engine.device == CUDA1, f"ZeRO-{stage}: the engine is on {engine.device}, LOCAL_RANK is 1"
        placed = {(p.device, p.dtype) for p in engine.module.parameters()}
        assert placed == {(CUDA1, DTYPES[precision])}, f"ZeRO-{stage} {precision}: parameters at {placed}"
        assert (out.device, out.dtype, tuple(out.shape)) == (CUDA1, DTYPES[precision], (4, 4, 4, 4, 4))
        guard = [op for op, devices in node.collectives if "allgather" in op]
        # the guard's two agreements (DSP group, world) plus the primitives' first-call checks
        assert len(guard) >= 2, f"ZeRO-{stage}: the first forward issued no agreement all-gather: {guard}"
        engine.destroy()


def test_the_guard_judges_on_the_local_gpu() -> None:
    """A model that never shards: the guard's verdict, read from its all-gathered rows, stops the forward."""
    from dsp_plugin.deepspeed import DSPGuardError

    with fake_cuda_node(local_rank=1) as node, pytest.raises(DSPGuardError) as caught:
        first_forward(node, launch_config(2, "fp32"), parallel=False)
    assert "the first forward issued no DSP split or switch on rank(s) [0, 1]" in str(caught.value)
