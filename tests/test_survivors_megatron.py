"""Megatron's full-attention layers where the mixed-model tests could not tell: other patterns, steady state.

Issue 29's survivors 6 and 11, and its narrow Megatron length catch, on 2 ranks of one spawn:

- pipeline stages build each layer's kind from its *global* number: with the pattern
  ``(spatial, temporal, full)`` over 4 layers and PP=2, stage 1 holds layers 3 (full)
  and 4 (spatial); numbered from 1 on the stage it would build spatial and temporal
  (the suite's ``(spatial, full, temporal, full)`` gives the same classes either way);
- a full layer's core attention, after its first call, issues its two all-to-alls and
  nothing else: no all_gather and no fingerprint exchange (no host sync) per call,
  so it never asks the group for the head count or the sequence length;
- the lengths each rank's core attention sees at ``T != S`` (5 frames, 6 patches,
  sharded on either dim): a swapped frame / patch length, hidden at the default
  ``T = S = 6``, changes the output here.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402

PP_PATTERN = ("spatial", "temporal", "full")


def _stages(rank: int, n: int) -> dict[str, Any]:
    """PP=2 (DSP=1): the class and attended dim of each layer this stage built, by global layer number."""
    from megatron.core import parallel_state as ps

    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model
    from dsp_plugin.topology import set_topology
    from tests.megatron_compositions import TEXT_DIM, TEXT_LEN, VIDEO, tiny_config

    install_cuda_shim()
    initialize_dsp_model_parallel(tp=1, dsp=1, pp=2, timeout_minutes=2)
    try:
        config = tiny_config(1, 2)
        config.dsp_attend_pattern = PP_PATTERN
        try:
            model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN,
                                pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        except Exception as exc:  # noqa: BLE001 - reported with the stage
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"layers": {layer.layer_number: (type(layer).__name__, layer.attend_dim)
                           for layer in model.decoder.layers}}
    finally:
        ps.destroy_model_parallel()
        set_topology(None)


def _core_attention(rank: int, n: int) -> dict[str, Any]:
    """``HeadSwitchCoreAttention`` (GQA 4/2, T = 5, S = 6) against SDPA on the full tokens, and its collectives."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.megatron.config import FRAME_DIM, PATCH_DIM, DSPTransformerConfig
    from dsp_plugin.megatron.full_attention import HeadSwitchCoreAttention, grid_carrier
    from dsp_plugin.megatron.layers import SDPACoreAttention

    frames, patches, batch, heads, groups, size = 5, 6, 2, 4, 2, 8
    config = DSPTransformerConfig(num_layers=2, hidden_size=heads * size, num_attention_heads=heads,
                                  num_query_groups=groups, dsp_attend_pattern=("spatial", "full"),
                                  use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    ours = HeadSwitchCoreAttention(config, 2, AttnMaskType.no_mask, "self", pg_collection=SimpleNamespace(
        cp=dist.group.WORLD), local_attention=SDPACoreAttention)
    reference = SDPACoreAttention(config, 2, AttnMaskType.no_mask, "self")
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(frames, patches, batch, h, size, generator=gen, dtype=torch.float64)
            for h in (heads, groups, groups)]
    expected = reference(*(t.flatten(0, 1) for t in full), None).view(frames, patches, batch, -1)
    out: dict[str, Any] = {}
    for name, shard in (("frames", FRAME_DIM), ("patches", PATCH_DIM)):
        dim = 0 if shard == FRAME_DIM else 1
        local = [t.tensor_split(n, dim=dim)[rank].flatten(0, 1) for t in full]
        try:
            with CommAccounting(activations=False) as first:
                ours(*local, grid_carrier((frames, patches), shard))
            with CommAccounting(activations=False) as again:
                got = ours(*local, grid_carrier((frames, patches), shard))
        except Exception as exc:  # noqa: BLE001 - reported with the case; both ranks raise (same lengths)
            out[name] = {"raised": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"error": (got - expected.tensor_split(n, dim=dim)[rank].flatten(0, 1)).abs().max().item(),
                     "first": [r.op for r in first.records],
                     "again": [r.op for r in again.records] + ["fingerprint exchange"] * len(again.check_records)}
    return out


def _worker(rank: int, n: int) -> dict[str, Any]:
    return {"stages": _stages(rank, n), "core": _core_attention(rank, n)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=300)


def test_pipeline_stages_build_the_kind_of_each_global_layer(results: list[dict[str, Any]]) -> None:
    from dsp_plugin.megatron.config import ATTEND

    for stage, result in enumerate(r["stages"] for r in results):
        assert "error" not in result, (f"PP=2, pattern {PP_PATTERN}: building stage {stage} (layers "
                                       f"{2 * stage + 1}-{2 * stage + 2}) raised {result['error']}")
        for number in (2 * stage + 1, 2 * stage + 2):
            kind = PP_PATTERN[(number - 1) % len(PP_PATTERN)]
            expected = ("DSPFullAttentionLayer" if kind == "full" else "DSPSpatialTemporalLayer", ATTEND[kind])
            assert result["layers"].get(number) == expected, (
                f"PP=2, pattern {PP_PATTERN}: stage {stage} built global layer {number} as "
                f"{result['layers'].get(number)}, expected {expected} ({kind!r}); the kind comes from the global "
                f"layer number (the stage's pipeline offset added)")


def test_full_layer_core_attention_at_t_not_s_and_no_collective_but_its_two(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["core"] for r in results):
        for shard, d in result.items():
            assert "raised" not in d, (f"core attention sharded on {shard}, 5 frames x 6 patches, rank {rank} of 2: "
                                       f"{d.get('raised')}")
            assert d["error"] < 1e-12, (f"core attention sharded on {shard}, 5 frames x 6 patches, rank {rank} of 2: "
                                        f"output {d['error']:.3g} off SDPA on the full tokens (fp64)")
            assert d["again"] == ["all_to_all", "all_to_all"], (
                f"core attention sharded on {shard}, rank {rank}: a steady-state call issued {d['again']} (first "
                f"call: {d['first']}); expected to_heads' and from_heads' all-to-alls only: the head count and the "
                f"global length are known, so no all_gather or host sync per layer per forward")
