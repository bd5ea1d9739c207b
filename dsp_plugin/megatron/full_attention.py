"""The full-attention layer kind: a DSP layer whose self-attention spans every token, through the head switch.

A ``"full"`` entry of ``dsp_attend_pattern`` makes a layer attend over all
``T * S`` tokens of a sample (Wan, HunyuanVideo, CogVideoX style), so a model may
mix factorized (spatial / temporal) and full-attention layers. Such a layer
attends along no sequence dim, so it keeps the shard it receives (no
``dynamic_switch``); inside its self-attention, q, k and v switch from the
sequence shard to a head shard and back (``dsp_plugin.head_switch``). Shapes
(``N`` DSP ranks, ``h`` heads per TP rank, ``h_r`` this rank's share of them)::

    layer in     [T_x * S_x, B, D]   sharded on T or S, as the previous layer left it
    fold         [B, T_x, S_x, D] -> [T_x * S_x, B, D]   (the local tokens, one sequence)
    linear_qkv   q, k, v [T_x * S_x, B, h, d]            (Megatron's SelfAttention, TP-split heads)
    core attention (HeadSwitchCoreAttention):
        unflatten    [T_x, S_x, B, h, d]
        to_heads     [T, S, B, h_r, d]                   ONE all-to-all for q, k, v (seq dim: the sharded one)
        local core   [T * S, B, h_r, d] -> [T * S, B, h_r * d]   (SDPACoreAttention: torch SDPA, CPU and GPU)
        from_heads   [T_x, S_x, B, h, d] -> [T_x * S_x, B, h * d]   one all-to-all back
    linear_proj, cross-attention (local: queries sharded, text replicated), MLP: as the factorized layers
    layer out    [T_x * S_x, B, D]   the same shard as the input

Everything but the attention is the factorized layer's own code
(:class:`~dsp_plugin.megatron.dsp_layer.DSPSpatialTemporalLayer`): adaLN-Zero,
cross-attention, MLP, the submodules from ``dsp_layer_spec``. The spec's layer
class is :class:`DSPVideoLayer`, which builds the kind the pattern names for each
global layer number. Positions: with ``position_embedding_type="rope"`` a full
layer rotates q and k by each token's global ``(t, h, w)`` (3-D RoPE, ``rope.py``:
the rows of ``video_rope``'s tables at the frames and patches this rank holds);
otherwise it adds no positional table (the factorized layers add sin-cos positions
along the dim they attend; a model that starts with full layers needs its own
positions before the block).

The core attention learns the global ``(T, S)`` and the sharded dim from its
``attention_mask`` argument, which a full layer's self-attention does not otherwise
use: the layer passes :func:`grid_carrier`, an empty CPU tensor whose *shape* is ``[0, T, S, shard_dim]``
(read from the shape, never from values: no ``.tolist()``, so ``torch.compile`` traces it without a graph
break or a host read, the lengths being Python ints at trace time).
It travels wherever Megatron takes q, k and v, also into the checkpoint of selective
recompute (``--recompute-granularity selective``, ``core_attn``), which re-runs the
core attention in backward, outside the layer's forward. Under full recompute the
head switch is recomputed with the layer (two all-to-alls more in backward), under
selective recompute the core attention with its head switch (likewise). With
``--transformer-impl transformer_engine`` the local core attention is Transformer
Engine's, built for the heads this rank holds after the switch (GPU only: the spec
imports TE lazily and refuses without it).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from dsp_plugin.head_switch import from_heads, local_head_counts, to_heads
from dsp_plugin.megatron.config import ATTEND, FRAME_DIM, FULL, DSPTransformerConfig, local_grid
from dsp_plugin.megatron.dsp_layer import DSPSpatialTemporalLayer
from dsp_plugin.megatron.rope import full_layer_table
from dsp_plugin.megatron.tokens import shard_range

__all__ = ["DSPFullAttentionLayer", "DSPVideoLayer", "HeadSwitchCoreAttention", "grid_carrier", "head_share_config",
           "layer_kind"]


def grid_carrier(grid: tuple[int, int], shard_dim: int) -> torch.Tensor:
    """An empty int64 CPU tensor of shape ``[0, T, S, shard_dim]``: what a full layer hands its core attention in
    ``attention_mask``.

    Data, not a tag or a scope: it survives Megatron's selective-recompute checkpoint (which detaches its
    inputs and re-runs the core attention in backward). The lengths are its shape, not its values, so reading
    them is no host read, and under ``torch.compile`` they are Python ints at trace time (a value carrier's
    ``.tolist()`` is a graph break: dynamo does not trace a tensor's values into ints).
    """
    return torch.empty((0, grid[0], grid[1], shard_dim), dtype=torch.int64, device="cpu")


def _read_carrier(carrier: object, where: str) -> tuple[tuple[int, int], int]:
    if (not isinstance(carrier, torch.Tensor) or carrier.device.type != "cpu" or carrier.dtype != torch.int64
            or carrier.dim() != 4 or carrier.shape[0] != 0):
        got = (carrier.dtype, carrier.device, tuple(carrier.shape)) if isinstance(carrier, torch.Tensor) else carrier
        raise ValueError(f"{where}: attention_mask must carry the video grid as an empty int64 CPU tensor of shape "
                         f"[0, T, S, shard_dim] (grid_carrier; DSPFullAttentionLayer passes it), got {got}")
    _, frames, patches, shard = carrier.shape
    return (frames, patches), shard


def layer_kind(config: DSPTransformerConfig, layer_number: int) -> str:
    """``"spatial"``, ``"temporal"`` or ``"full"`` for global layer ``layer_number`` (1-based)."""
    pattern = config.dsp_attend_pattern
    return pattern[(layer_number - 1) % len(pattern)]


class HeadSwitchCoreAttention(MegatronModule):
    """Core attention over the full sequence of a DSP-sharded full layer: to_heads, local attention, from_heads.

    Megatron's core-attention contract: q ``[s, b, h, d]``, k and v ``[s, b, h_kv, d]``
    -> ``[s, b, h * d]``, here with ``s`` the local tokens ``T_x * S_x``. The switch
    runs along the sharded video dim (``[T_x, S_x, ..]`` unflattened), whose global
    length comes from the layer's input, so the full sequence arrives in row-major ``(t, s)``
    order; the global lengths and the sharded dim come in ``attention_mask`` (:func:`grid_carrier`; a full
    layer's self-attention is unmasked). ``local_attention`` is the core attention class the layer spec names
    (:class:`~dsp_plugin.megatron.layers.SDPACoreAttention` takes any head count; Transformer Engine's
    ``TEDotProductAttention`` is built for this rank's share of the heads, :func:`head_share_config`).
    The DSP group is ``pg_collection.cp``.
    """

    def __init__(self, config: DSPTransformerConfig, layer_number: int, attn_mask_type: Any,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, *, local_attention: Any) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"HeadSwitchCoreAttention: attention_type={attention_type!r}; the head switch is for "
                             "self-attention (cross-attention to replicated text stays local)")
        self.layer_number = layer_number
        self.group = pg_collection.cp
        if getattr(local_attention, "__name__", "") == "TEDotProductAttention":
            config = head_share_config(config, self.group.size(), self.group.rank())
        self.local = local_attention(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                                     attention_type=attention_type, attention_dropout=attention_dropout,
                                     softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                                     pg_collection=pg_collection)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        grid, shard = _read_carrier(attention_mask, f"HeadSwitchCoreAttention (layer {self.layer_number})")
        frames, patches = local_grid(grid, shard, self.group.size(), self.group.rank())
        seq_dim = 0 if shard == FRAME_DIM else 1
        full_len = grid[shard - FRAME_DIM]
        # [T_x * S_x, b, h, d] -> [T_x, S_x, b, h, d] -> (to_heads) [T, S, b, h_r, d]
        q, k, v = (t.unflatten(0, (frames, patches)) for t in (query, key, value))
        wire = self.config.dsp_comm_dtype
        q, k, v = to_heads(q, k, v, seq_dim=seq_dim, head_dim=3, group=self.group, global_len=full_len,
                           comm_dtype=wire)
        # [T, S, b, h_r, d] -> [T * S, b, h_r, d] -> local attention -> [T * S, b, h_r * d]
        out = self.local(*(t.flatten(0, 1) for t in (q, k, v)), None, attn_mask_type=attn_mask_type,
                         attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        # [T * S, b, h_r * d] -> [T, S, b, h_r, d] -> (from_heads) [T_x, S_x, b, h, d] -> [T_x * S_x, b, h * d]
        out = out.unflatten(-1, (q.shape[3], -1)).unflatten(0, (q.shape[0], q.shape[1]))
        out = from_heads(out, seq_dim=seq_dim, head_dim=3, group=self.group, heads=query.shape[2], comm_dtype=wire)
        return out.flatten(3).flatten(0, 1)


def head_share_config(config: DSPTransformerConfig, n: int, rank: int) -> DSPTransformerConfig:
    """A copy of ``config`` whose heads per TP rank are those DSP rank ``rank`` of ``n`` holds after the head
    switch (query heads and K/V groups, ``head_switch.local_head_counts``): Transformer Engine's core attention
    is built for a fixed head count and checks it on every call. Every rank must hold a head (TE takes no empty
    head dim), which every rank checks alike."""
    import copy

    tp = config.tensor_model_parallel_size
    heads, kv_heads = config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp
    if heads < n:
        raise ValueError(f"DSPFullAttentionLayer: the Transformer Engine core attention needs a head on every DSP "
                         f"rank, but {heads} heads per TP rank (num_attention_heads {config.num_attention_heads} / "
                         f"tp {tp}) over dsp size {n} leave ranks without one; use --dsp-size <= {heads} or "
                         "--transformer-impl local (torch SDPA takes an empty head dim)")
    local_heads, local_kv = local_head_counts(heads, kv_heads, n, rank)
    share = copy.copy(config)  # no re-validation: only the two head counts differ
    share.num_attention_heads, share.num_query_groups = local_heads * tp, local_kv * tp
    return share


def _with_head_switch(submodules: Any) -> Any:
    """The layer's submodules with the self-attention's core attention wrapped in the head switch."""
    attention = submodules.self_attention
    local = attention.submodules.core_attention
    core = partial(HeadSwitchCoreAttention, local_attention=local)
    self_attention = ModuleSpec(module=attention.module, params=attention.params,
                                submodules=dataclasses.replace(attention.submodules, core_attention=core))
    return dataclasses.replace(submodules, self_attention=self_attention)


class DSPFullAttentionLayer(DSPSpatialTemporalLayer):
    """A DSP layer attending over every token of the sample (the ``"full"`` kind); keeps its input's shard."""

    def __init__(self, config: DSPTransformerConfig, submodules: Any, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection: Any = None, vp_stage: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, _with_head_switch(submodules), layer_number, hidden_dropout, pg_collection,
                         vp_stage, **kwargs)
        if self.attend_dim is not FULL:
            raise ValueError(f"DSPFullAttentionLayer: layer {self.layer_number} is "
                             f"{layer_kind(config, self.layer_number)!r} in dsp_attend_pattern="
                             f"{config.dsp_attend_pattern}; expected 'full'")
        self.add_positions = False
        self.rope = config.position_embedding_type == "rope"  # 3-D: every token's global (t, h, w)

    def _self_attention_mask(self, grid: tuple[int, int], shard: int) -> torch.Tensor:
        return grid_carrier(grid, shard)  # the head switch's global lengths, through any recompute

    def _rotary_table(self, rotary_pos_emb: Any, grid: tuple[int, int], shard: int,
                      name: str) -> torch.Tensor | None:
        """The 3-D table of the tokens this rank holds: its frames (or all) x all patches (or its)."""
        if not self.rope:
            return super()._rotary_table(rotary_pos_emb, grid, shard, name)
        _, n, rank = self._dsp()
        frames = shard_range(grid[0], n, rank) if shard == FRAME_DIM else slice(None)
        patches = slice(None) if shard == FRAME_DIM else shard_range(grid[1], n, rank)
        return full_layer_table(rotary_pos_emb, grid, frames, patches, name)

    def _fold_rows(self, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return m[None]  # the fold [T_x * S_x, B, D] keeps the batch as it is

    def _fold(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T_x, S_x, D] -> [T_x * S_x, B, D]``: the local tokens as one sequence (the head switch spans them)."""
        return x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[3])

    def _unfold(self, h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        batch, frames, patches, hidden = like.shape
        return h.view(frames, patches, batch, hidden).permute(2, 0, 1, 3)


class DSPVideoLayer(BaseTransformerLayer):
    """The layer ``dsp_layer_spec`` names: builds the kind ``dsp_attend_pattern`` gives each global layer.

    ``"spatial"``/``"temporal"``: :class:`DSPSpatialTemporalLayer`; ``"full"``:
    :class:`DSPFullAttentionLayer`. (A ``TransformerBlock`` builds every layer
    from one spec; the global layer number, with the pipeline offset, decides.
    A ``BaseTransformerLayer`` so that the block accepts the spec; ``__new__``
    returns the real layer, so this class never has an instance.)
    """

    def __new__(cls, config: DSPTransformerConfig, submodules: Any, layer_number: int = 1,
                hidden_dropout: float | None = None, pg_collection: Any = None, vp_stage: int | None = None,
                **kwargs: Any) -> DSPSpatialTemporalLayer:
        if not isinstance(config, DSPTransformerConfig):
            raise TypeError("DSPVideoLayer needs a DSPTransformerConfig (video geometry and attend pattern), got "
                            f"{type(config).__name__}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        offset = get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        full = ATTEND[layer_kind(config, layer_number + offset)] is FULL
        layer_cls = DSPFullAttentionLayer if full else DSPSpatialTemporalLayer
        return layer_cls(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage, **kwargs)
