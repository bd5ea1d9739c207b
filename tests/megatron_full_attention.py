"""Oracle and workers for ``tests/test_megatron_full_attention.py``: a model mixing factorized and full layers.

The oracle is the plain-torch reference ``STDiT`` with its blocks laid out as the
pattern says: ``AxialBlock``s attending along S or T, and :class:`FullBlock`s,
``AxialBlock``s applied to the ``T * S`` tokens flattened into one sequence, with
3-D RoPE (written here from the reference's ``rope_angles``, sharing no code with
``dsp_plugin.megatron.rope``) when the variant has RoPE. It trains with torch SGD on
the whole global batch in one process (``megatron_compositions.reference_run``); the
Megatron layouts load its weights and train through real megatron-core
(``megatron_compositions.run_layouts``: a stock ``TransformerBlock`` of
``DSPVideoLayer``s, DDP over DP x CP, the pipeline schedules, ``finalize_model_grads``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsp_plugin.models.stdit import AxialBlock, STDiT, STDiTConfig, rope_angles
from tests.megatron_compositions import MIXED_PATTERN, TEXT_DIM, VIDEO, run_variants

PATTERN = MIXED_PATTERN


class FullBlock(AxialBlock):
    """An ``AxialBlock`` over every token of the sample: ``[B, T, S, D] -> [B, T * S, D]``, attend, back.

    ``patch_grid=(H, W)``: 3-D RoPE on q and k: of a head's ``d / 2`` rotated pairs (``(i, i + d/2)``), the
    first ``d/2 - 2 * (d // 6)`` turn by the token's frame, the next ``d // 6`` by its patch row, the last
    ``d // 6`` by its column, each axis with its own frequencies (Wan's split).
    """

    def __init__(self, config: STDiTConfig, patch_grid: tuple[int, int] | None = None) -> None:
        super().__init__(config, 1, add_pos_embed=False)
        self.patch_grid = patch_grid
        self.rope = patch_grid is not None

    def _angles(self, length: int, width: int | None, device: torch.device) -> torch.Tensor:
        height, width = self.patch_grid
        token = torch.arange(length, device=device)
        frame, row, column = token // (height * width), token % (height * width) // width, token % width
        spatial = self.head_dim // 6
        pairs = (self.head_dim // 2 - 2 * spatial, spatial, spatial)
        return torch.cat([rope_angles(p, n, self.rope_base) for p, n in zip((frame, row, column), pairs)], dim=-1)

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor | None = None, **kwargs: Any,
                ) -> torch.Tensor:
        return super().forward(x.flatten(1, 2), c, y, **kwargs).view_as(x)


def reference_model(config: Any) -> STDiT:
    """The oracle with ``PATTERN``'s blocks for a mixed variant's Megatron config (weights loaded by the caller)."""
    from dsp_plugin.megatron.weights import reference_config

    model = STDiT(reference_config(config, VIDEO.channels, TEXT_DIM, weights_only=True))
    rope = config.position_embedding_type == "rope"
    blocks, positioned = [], set()
    for kind in PATTERN:  # positions at the first block along each dim, as the Megatron layers add them
        if kind == "full":
            blocks.append(FullBlock(model.config, (VIDEO.height, VIDEO.width) if rope else None))
            continue
        dim = 2 if kind == "spatial" else 1
        blocks.append(AxialBlock(model.config, dim, add_pos_embed=dim not in positioned))
        positioned.add(dim)
    model.blocks = nn.ModuleList(blocks)
    return model


def two_ranks(rank: int, world_size: int, groups: list, steps: int) -> dict[str, Any]:
    """The 2-rank spawn: the core attention alone (:func:`core_attention_case`) and the layouts of ``groups``."""
    return {"core_attention": core_attention_case(rank, world_size),
            "layouts": run_variants(rank, world_size, groups, steps)}


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
    from dsp_plugin.megatron.full_attention import HeadSwitchCoreAttention, grid_carrier
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
        out = ours(*local, grid_carrier((frames, patches), input_shard_dim(config, 2)))
        out.backward(shard(grad))
        whole = [t.flatten(0, 1).clone().requires_grad_(True) for t in full]
        expected = reference(*whole, None)
        expected.backward(grad.flatten(0, 1))
        expected_grads = [shard(t.grad.view(frames, patches, *t.shape[1:])) for t in whole]
        diffs.append(max([(out - shard(expected.view(frames, patches, batch, -1))).abs().max().item()]
                         + [(t.grad - g).abs().max().item() for t, g in zip(local, expected_grads)]))
    return diffs
