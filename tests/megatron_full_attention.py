"""Worker and oracle for ``tests/test_megatron_full_attention.py``: a model mixing factorized and full layers.

The oracle is the plain-torch reference ``STDiT`` with its blocks laid out as the
pattern says: ``AxialBlock``s attending along S or T, and :class:`FullBlock`s,
``AxialBlock``s applied to the ``T * S`` tokens flattened into one sequence. It
trains with torch SGD on the whole global batch in one process; the Megatron
runs load its weights and train through real megatron-core (a stock
``TransformerBlock`` of ``DSPVideoLayer``s, DDP over DP x CP, the pipeline
schedules, ``finalize_model_grads``), as ``megatron_compositions`` does for the
factorized model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.models.stdit import AxialBlock, STDiT, STDiTConfig
from tests.megatron_compositions import GLOBAL_BATCH, LR, SEED, TEXT_DIM, TEXT_LEN, VIDEO, dataset, tiny_config

#: layer 1 spatial (entry shard T), 2 full on the T shard, 3 temporal (switch T -> S), 4 full on the S shard
PATTERN = ("spatial", "full", "temporal", "full")


class FullBlock(AxialBlock):
    """An ``AxialBlock`` over every token of the sample: ``[B, T, S, D] -> [B, T * S, D]``, attend, back."""

    def __init__(self, config: STDiTConfig) -> None:
        super().__init__(config, 1, add_pos_embed=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x.flatten(1, 2), c, y).view_as(x)


def reference_model() -> STDiT:
    """The oracle with ``PATTERN``'s blocks and the weights ``build_model(seed=SEED)`` loads (any pattern)."""
    from dsp_plugin.megatron.steps import reference_weights
    from dsp_plugin.megatron.weights import reference_config

    config = mixed_config(1, 1)
    model = STDiT(reference_config(config, VIDEO.channels, TEXT_DIM, weights_only=True))
    blocks, positioned = [], set()
    for kind in PATTERN:  # positions at the first block along each dim, as the Megatron layers add them
        if kind == "full":
            blocks.append(FullBlock(model.config))
            continue
        dim = 2 if kind == "spatial" else 1
        blocks.append(AxialBlock(model.config, dim, add_pos_embed=dim not in positioned))
        positioned.add(dim)
    model.blocks = nn.ModuleList(blocks)
    model.load_state_dict(reference_weights(config, VIDEO, TEXT_DIM, SEED))
    return model


def mixed_config(tp: int, pp: int, *, recompute: bool = False) -> Any:
    config = tiny_config(tp, pp, recompute=recompute)
    config.dsp_attend_pattern = PATTERN
    return config


def reference_run(steps: int) -> dict[str, Any]:
    """Losses and Megatron-named full gradients per step of the oracle."""
    from dsp_plugin.megatron.weights import megatron_names

    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = dataset(steps)
    losses, grads = [], []
    for step in range(steps):
        batch = torch.utils.data.default_collate([data[step * GLOBAL_BATCH + i] for i in range(GLOBAL_BATCH)])
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch["latents"], batch["timestep"], batch["text"]), batch["target"])
        loss.backward()
        losses.append(loss.item())
        grads.append(megatron_names({n: p.grad.clone() for n, p in model.named_parameters()},
                                    model.config.num_heads))
        optimizer.step()
    return {"losses": losses, "grads": grads}


def run_layouts(rank: int, world_size: int, layouts: list[tuple[int, int, int, int, int, bool]],
                steps: int) -> list[dict[str, Any]]:
    """Per layout ``(tp, dsp, pp, micro batch, micro batches, recompute)``: losses, main_grads, step-0 collectives."""
    from megatron.core import parallel_state as ps
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from dsp_plugin.megatron.cpu import install_cuda_shim, train_step, wrap_ddp
    from dsp_plugin.megatron.full_attention import DSPFullAttentionLayer
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model
    from dsp_plugin.megatron.weights import global_parameter_name
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    out = []
    for tp, dsp, pp, mbs, num_mb, recompute in layouts:
        initialize_dsp_model_parallel(tp=tp, dsp=dsp, pp=pp, timeout_minutes=2)
        try:
            config = mixed_config(tp, pp, recompute=recompute)
            model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN, seed=SEED,
                                pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
            ddp = wrap_ddp(model, config)
            optimizer = torch.optim.SGD(ddp.module.parameters(), lr=LR)
            data = dataset(steps)
            sampler = MegatronPretrainingSampler(
                total_samples=len(data), consumed_samples=0, micro_batch_size=mbs,
                data_parallel_rank=ps.get_data_parallel_rank(), data_parallel_size=ps.get_data_parallel_world_size())
            batches = iter(torch.utils.data.DataLoader(data, batch_sampler=sampler))
            losses, grads, collectives = [], [], None
            tp_rank = ps.get_tensor_model_parallel_rank()
            for step in range(steps):
                with CommAccounting(activations=False) as acct:
                    losses.append(train_step([ddp], batches, optimizer, num_microbatches=num_mb,
                                             micro_batch_size=mbs, seq_length=VIDEO.tokens))
                if step == 0:
                    collectives = [(r.op, r.group_size, r.phase) for r in acct.records]
                grads.append({
                    global_parameter_name(name, model.layer_offset): (
                        tp_rank, getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False)
                        else None, p.main_grad.detach().numpy().copy())
                    for name, p in model.named_parameters()})
            kinds = ["full" if isinstance(layer, DSPFullAttentionLayer) else "factorized"
                     for layer in model.decoder.layers]
            out.append({"losses": losses, "grads": grads, "tp_rank": tp_rank, "collectives": collectives,
                        "kinds": kinds, "stage_layers": len(model.decoder.layers)})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out


def core_attention_case(rank: int, n: int) -> list[float]:
    """``HeadSwitchCoreAttention`` on this rank's shard against ``SDPACoreAttention`` on the full tokens.

    GQA (4 query heads, 2 K/V groups), T = 5 and S = 3 uneven over ``n``; layer 2 is full and
    receives the T shard (pattern spatial, full) or the S shard (temporal, full).
    Returns the max |difference| of the output and of the q, k, v gradients, per case.
    """
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from dsp_plugin.megatron.config import FRAME_DIM, DSPTransformerConfig, input_shard_dim
    from dsp_plugin.megatron.full_attention import HeadSwitchCoreAttention, attention_grid
    from dsp_plugin.megatron.layers import SDPACoreAttention

    frames, patches, batch, heads, groups, size = 5, 3, 2, 4, 2, 8
    diffs = []
    for pattern in (("spatial", "full"), ("temporal", "full")):
        config = DSPTransformerConfig(num_layers=2, hidden_size=heads * size, num_attention_heads=heads,
                                      num_query_groups=groups,
                                      dsp_attend_pattern=pattern, use_cpu_initialization=True,
                                      attention_dropout=0.0, hidden_dropout=0.0)
        pg = SimpleNamespace(cp=dist.group.WORLD)
        ours = HeadSwitchCoreAttention(config, 2, AttnMaskType.no_mask, "self", pg_collection=pg,
                                       local_attention=SDPACoreAttention)
        reference = SDPACoreAttention(config, 2, AttnMaskType.no_mask, "self")
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(frames, patches, batch, h, size, generator=gen, dtype=torch.float64)
                for h in (heads, groups, groups)]
        grad = torch.randn(frames, patches, batch, heads * size, generator=gen, dtype=torch.float64)
        dim = 0 if input_shard_dim(config, 2) == FRAME_DIM else 1

        def shard(t: torch.Tensor, dim: int = dim) -> torch.Tensor:
            return t.tensor_split(n, dim=dim)[rank].flatten(0, 1)

        local = [shard(t).clone().requires_grad_(True) for t in full]
        with attention_grid((frames, patches), input_shard_dim(config, 2)):
            out = ours(*local, None)
        out.backward(shard(grad))
        whole = [t.flatten(0, 1).clone().requires_grad_(True) for t in full]
        expected = reference(*whole, None)
        expected.backward(grad.flatten(0, 1))
        expected_grads = [shard(t.grad.view(frames, patches, *t.shape[1:])) for t in whole]
        diffs.append(max([(out - shard(expected.view(frames, patches, batch, -1))).abs().max().item()]
                         + [(t.grad - g).abs().max().item() for t, g in zip(local, expected_grads)]))
    return diffs
