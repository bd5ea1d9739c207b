"""The DSP spatial-temporal layer: a megatron-core ``TransformerLayer`` that a stock ``TransformerBlock`` drives.

One layer of a video DiT (OpenSora / Latte family) with adaLN timestep
modulation and cross-attention to text. Shapes (``B`` batch, ``T`` frames,
``S`` patches, ``D`` hidden; ``_l`` a local DSP chunk; ``L_a`` the attended length)::

    in   [T_x * S_x, B, D]     Megatron's layout, tokens (t, s) row-major, one of T/S sharded
    ->   [B, T_x, S_x, D]      if sharded along the attend dim: dynamic_switch (one all-to-all)
    ->   adaLN: x + gate1 * SelfAttn(norm(fold(x)) * (1 + scale1) + shift1)
         fold: [B, T, S_l, D] -> [T, B * S_l, D] (temporal) or [B, T_l, S, D] -> [S, B * T_l, D]
    ->   [T_x * S_x, B, D]     x + CrossAttn(norm(x), text)   (queries local, text replicated: no comm)
    ->   x + gate2 * MLP(norm(x) * (1 + scale2) + shift2)
    out  [T_x * S_x, B, D]     sharded on the dim this layer does not attend along

The global lengths ``(T, S)`` come with the tensor: the hidden states carry a
:class:`~dsp_plugin.layout.ShardSpec` ``S(0)`` folding ``grid=(T, S)`` with
``axis`` the sharded one (the model entry or :func:`~dsp_plugin.megatron.tokens.split_video_tokens`
attaches it, each layer re-attaches it to its output), so frames and resolution
may change from one batch to the next. Nothing is read from the config.

The conditioning travels the way ``TransformerBlock`` (and its full-recompute
path, ``checkpointed_forward``) hands tensors to layers:

- ``attention_mask``: the timestep embedding ``c [B, D]`` (a DSP layer's self-attention
  is unmasked; NeMo's DiT layers use the same slot), or with adaLN-single the
  model's ``t_block`` output ``[B, 6D]``;
- ``context`` the projected text ``[L_text, B, D]`` and ``context_mask`` its key
  padding ``[B, 1, 1, L_text]`` (True: padding, Megatron's convention);
- ``rotary_pos_emb``: with ``position_embedding_type="rope"`` the pair
  ``(temporal, spatial)`` of rotary tables ``[L, 1, 1, head_dim]`` (or None) over
  the *global* frame and patch indices (:func:`~dsp_plugin.megatron.tokens.video_rope`);
  the attended dim is never sharded, so Megatron's own ``apply_rotary_pos_emb``
  rotates every local token by its global position.

Refused with a clear error: packed sequences, attention biases, Megatron-SP, and
configs with ``context_parallel_size != 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank
from torch import nn

from dsp_plugin import layout
from dsp_plugin.comm import dynamic_switch
from dsp_plugin.megatron.config import (
    ATTEND,
    FRAME_DIM,
    PATCH_DIM,
    DSPTransformerConfig,
    attend_dim,
    input_shard_dim,
    local_grid,
    output_shard_dim,
    rope_dims,
)
from dsp_plugin.megatron.dropout import sharded_dropout
from dsp_plugin.megatron.recompute import SwitchReplayCache, first_layer_of_a_chunk
from dsp_plugin.megatron.rope import factorized_table

__all__ = ["DSPSpatialTemporalLayer", "attach_video_grid", "sincos_positions", "video_grid"]


def sincos_positions(length: int, dim: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fixed sinusoidal positions ``[length, dim]`` (the plain-torch reference's ``sincos``)."""
    import math

    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1).to(dtype)


def attach_video_grid(tokens: torch.Tensor, grid: tuple[int, int], shard_dim: int) -> torch.Tensor:
    """Tag ``[T_x * S_x, B, D]`` as the shard on ``shard_dim`` (1: T, 2: S) of the global ``grid = (T, S)``."""
    frames, patches = grid
    return layout.attach(tokens, 0, frames * patches, grid=(frames, patches), axis=shard_dim - FRAME_DIM)


def video_grid(tokens: torch.Tensor, where: str) -> tuple[tuple[int, int], int]:
    """``((T, S), shard_dim)`` from the tag of Megatron-layout hidden states; a clear error without one."""
    spec = layout.shard_spec(tokens)
    if spec is None or spec.dim != 0 or len(spec.grid) != 2:
        raise ValueError(f"{where}: the hidden states [T_x * S_x, B, D] {tuple(tokens.shape)} carry no video "
                         f"shard tag (got {spec}); build them with split_video_tokens(x) or tag them with "
                         "attach_video_grid(hidden, (T, S), shard_dim): the global frames and patches travel "
                         "with the tensor, not the config")
    return (spec.grid[0], spec.grid[1]), FRAME_DIM + spec.axis


class DSPSpatialTemporalLayer(TransformerLayer):
    """A ``TransformerLayer`` that attends along one video dim and keeps the other DSP-sharded.

    Built from a ``ModuleSpec`` (``dsp_plugin.megatron.layers.dsp_layer_spec``);
    its submodules are Megatron's own (``SelfAttention``, ``CrossAttention``,
    ``MLP``, norms; q/k norms only with ``config.qk_layernorm``). The adaLN
    modulation ``SiLU -> Linear(D, 6D)`` is replicated over TP and
    zero-initialised (adaLN-Zero) when the config initialises weights; with
    ``dsp_adaln_single`` it is a learned ``scale_shift_table [6, D]`` added to the
    model's shared modulation (PixArt).
    """

    def __init__(self, config: DSPTransformerConfig, submodules: Any, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection: Any = None, vp_stage: int | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(config, DSPTransformerConfig):
            raise TypeError("DSPSpatialTemporalLayer needs a DSPTransformerConfig (video geometry and attend "
                            f"pattern), got {type(config).__name__}")
        if config.sequence_parallel:
            raise ValueError("DSPSpatialTemporalLayer: Megatron sequence parallelism (--sequence-parallel) is not "
                             "supported inside DSP layers; DSP already shards the sequence")
        super().__init__(config, _without_disabled_qk_norms(submodules, config), layer_number, hidden_dropout,
                         pg_collection, vp_stage, **kwargs)
        hidden = config.hidden_size
        device = "cpu" if config.use_cpu_initialization else None
        if config.dsp_adaln_single:
            self.scale_shift_table = nn.Parameter(torch.empty(6, hidden, dtype=config.params_dtype, device=device))
            if config.perform_initialization:  # as PixArt: randn / sqrt(D)
                nn.init.normal_(self.scale_shift_table, std=hidden**-0.5)
        else:
            self.adaln_modulation = nn.Linear(hidden, 6 * hidden, dtype=config.params_dtype, device=device)
            if config.perform_initialization:  # adaLN-Zero: every block starts as the identity
                nn.init.zeros_(self.adaln_modulation.weight)
                nn.init.zeros_(self.adaln_modulation.bias)
        self.attend_dim = attend_dim(config, self.layer_number)
        self.input_shard_dim = input_shard_dim(config, self.layer_number)
        self.output_shard_dim = output_shard_dim(config, self.layer_number)
        self.rope = self.attend_dim in rope_dims(config)
        pattern = config.dsp_attend_pattern
        first = [ATTEND[p] for p in pattern].index(self.attend_dim) + 1
        self.add_positions = (config.dsp_sincos_positions and config.position_embedding_type != "none"
                              and not self.rope and self.layer_number == first)
        stage_offset = get_transformer_layer_offset(config, vp_stage, get_pg_rank(self.pg_collection.pp))
        self.switch_cache = (SwitchReplayCache(keep_outputs=not config.distribute_saved_activations)
                             if first_layer_of_a_chunk(config, self.layer_number - 1 - stage_offset) else None)

    # -- layout ------------------------------------------------------------------------------

    def _dsp(self) -> tuple[Any, int, int]:
        group = self.pg_collection.cp
        return group, group.size(), group.rank()

    def _to_grid(self, tokens: torch.Tensor, grid: tuple[int, int], shard_dim: int) -> torch.Tensor:
        """``[T_x * S_x, B, D] -> [B, T_x, S_x, D]`` (T_x, S_x from the global grid and the shard)."""
        _, n, rank = self._dsp()
        frames, patches = local_grid(grid, shard_dim, n, rank)
        if tokens.shape[0] != frames * patches:
            raise ValueError(f"{type(self).__name__} {self.layer_number}: got {tokens.shape[0]} local tokens, "
                             f"expected {frames} frames x {patches} patches: the shard on dim {shard_dim} of "
                             f"{grid[0]} frames x {grid[1]} patches over {n} DSP ranks")
        return tokens.view(frames, patches, tokens.shape[1], tokens.shape[2]).permute(2, 0, 1, 3)

    @staticmethod
    def _to_tokens(x: torch.Tensor) -> torch.Tensor:
        """``[B, T_x, S_x, D] -> [T_x * S_x, B, D]``, contiguous: the norms and linears after it read it as is (a
        strided view would be copied by each), and the layer's output, which inherits its layout, is the next
        checkpoint's input (``--distribute-saved-activations`` flattens it)."""
        return x.permute(1, 2, 0, 3).contiguous().view(-1, x.shape[0], x.shape[3])

    def _fold(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, S, D]`` -> ``[L_a, B * other, D]``: the attended dim first, the rest folded into the batch."""
        batch, frames, patches, hidden = x.shape
        if self.attend_dim == PATCH_DIM:  # [B, T_l, S, D] -> [S, B*T_l, D]
            return x.permute(2, 0, 1, 3).reshape(patches, batch * frames, hidden)
        return x.permute(1, 0, 2, 3).reshape(frames, batch * patches, hidden)  # -> [T, B*S_l, D]

    def _unfold(self, h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        batch, frames, patches, hidden = like.shape
        if self.attend_dim == PATCH_DIM:  # [S, B*T_l, D] -> [B, T_l, S, D]
            return h.view(patches, batch, frames, hidden).permute(1, 2, 0, 3)
        return h.view(frames, batch, patches, hidden).permute(1, 0, 2, 3)  # [T, B*S_l, D] -> [B, T, S_l, D]

    # -- forward -----------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                rotary_pos_emb: Any = None, rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                rotary_pos_cos_sin: Any = None, attention_bias: Any = None, inference_context: Any = None,
                packed_seq_params: Any = None, sequence_len_offset: Any = None, padding_mask: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states [T_x*S_x, B, D]``, ``attention_mask`` = timestep embedding ``[B, D]``,
        ``context`` = text ``[L_text, B, D]`` or None -> ``(hidden_states, context)``."""
        name = f"{type(self).__name__} {self.layer_number}"
        if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None:
            raise ValueError(f"{name}: precomputed rotary cos/sin (flash decoding) are not supported; pass the "
                             "rotary tables in rotary_pos_emb (tokens.video_rope)")
        if packed_seq_params is not None or attention_bias is not None or inference_context is not None:
            raise ValueError(f"{name}: packed sequences, attention biases and inference contexts are not "
                             "supported")
        width = (6 if self.config.dsp_adaln_single else 1) * hidden_states.shape[2]
        cond = attention_mask
        if cond is None or cond.dim() != 2 or cond.shape != (hidden_states.shape[1], width):
            what = "adaLN-single modulation [B, 6D]" if self.config.dsp_adaln_single else "timestep embedding [B, D]"
            raise ValueError(f"{name}: attention_mask must carry the {what} = [{hidden_states.shape[1]}, {width}], "
                             f"got {None if cond is None else tuple(cond.shape)}")
        cache = self.switch_cache if self.training else None  # first layer of a full-recompute chunk
        held = cache.original(hidden_states) if cache is not None else None
        # the recompute runs on a detached copy, whose tag is found through the live original (layout's alias
        # lookup) or, with --distribute-saved-activations (the checkpoint re-gathers its input into new memory,
        # under the same tensor object), through the chunk input the first run kept
        grid, shard = video_grid(hidden_states if held is None else held, name)
        if cache is not None:  # keep this tagged object alive until the recompute
            cache.hold(attach_video_grid(hidden_states, grid, shard))
        if shard != self.input_shard_dim:
            raise ValueError(f"{name}: the hidden states are sharded on dim {shard}, but with the attend pattern "
                             f"{self.config.dsp_attend_pattern} this layer receives dim {self.input_shard_dim}")
        rope = self._rotary_table(rotary_pos_emb, grid, shard, name)
        group, _, _ = self._dsp()
        x = self._to_grid(hidden_states, grid, self.input_shard_dim)
        if self.input_shard_dim == self.attend_dim:  # S(attend) -> S(other): one all-to-all
            cur, tgt = self.attend_dim, self.output_shard_dim
            wire = self.config.dsp_comm_dtype
            if cache is not None:  # full recompute: never replay the switch
                x = cache.switch(hidden_states, x, cur, tgt, group=group, cur_full=grid[cur - 1],
                                 tgt_full=grid[tgt - 1], comm_dtype=wire)
            else:
                x = dynamic_switch(x, cur, tgt, group=group, global_len=grid[cur - 1], comm_dtype=wire)
        elif cache is not None:
            cache.release(hidden_states)
        if self.add_positions:  # along the attended dim, which is never sharded: global positions
            length = x.shape[self.attend_dim]
            pos = sincos_positions(length, x.shape[-1], device=x.device, dtype=x.dtype)
            x = x + (pos[None, :, None] if self.attend_dim == FRAME_DIM else pos[None, None])
        if self.config.dsp_adaln_single:  # PixArt: the layer's table plus the shared t_block output
            mods = (self.scale_shift_table[None] + cond.view(cond.shape[0], 6, -1)).unbind(1)
        else:
            mods = self.adaln_modulation(nn.functional.silu(cond)).chunk(6, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods  # [B, D] each

        # norm and modulate in the folded layout: LayerNorm's copy of the strided fold is the only one, and
        # linear_qkv gets a contiguous input (Transformer Engine would copy a strided one once more)
        h = self.input_layernorm(self._fold(x)) * (1 + self._fold_rows(scale1, x)) + self._fold_rows(shift1, x)
        out, bias = self.self_attention(h, attention_mask=self._self_attention_mask(grid, shard),
                                        rotary_pos_emb=rope)
        x = x + gate1[:, None, None] * self._unfold(self._bias_dropout(out, bias), x)

        tokens = self._to_tokens(x)  # [T_x * S_x, B, D]
        if context is not None and not isinstance(self.cross_attention, IdentityOp):
            out, bias = self.cross_attention(self.pre_cross_attn_layernorm(tokens),
                                             attention_mask=self._caption_mask(context_mask, context, name),
                                             key_value_states=context)
            tokens = tokens + self._bias_dropout(out, bias)
        shift2, scale2, gate2 = (m[None] for m in (shift2, scale2, gate2))  # [1, B, D]
        h = self.pre_mlp_layernorm(tokens) * (1 + scale2) + shift2
        out, bias = self.mlp(h)
        out = tokens + gate2 * self._bias_dropout(out, bias)
        return attach_video_grid(out, grid, self.output_shard_dim), context

    def _rotary_table(self, rotary_pos_emb: Any, grid: tuple[int, int], shard: int,
                      name: str) -> torch.Tensor | None:
        """This layer's table from the ``(frames, patches)`` pair, checked against the attended length."""
        if not self.rope:
            if rotary_pos_emb is not None and self.config.position_embedding_type != "rope":
                raise ValueError(f"{name}: got rotary_pos_emb but position_embedding_type="
                                 f"{self.config.position_embedding_type!r}; use 'rope' (--position-embedding-type "
                                 "rope) so that the layers know to rotate q and k")
            return None
        return factorized_table(rotary_pos_emb, self.attend_dim, grid[self.attend_dim - 1], name)

    def _self_attention_mask(self, grid: tuple[int, int], shard: int) -> torch.Tensor | None:
        """What the self-attention's ``attention_mask`` carries: nothing (a factorized layer attends unmasked)."""
        return None

    def _fold_rows(self, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A per-sample ``[B, D]`` -> broadcastable over the fold ``[L_a, B * other, D]`` (``[1, B * other, D]``)."""
        other = x.shape[1] if self.attend_dim == PATCH_DIM else x.shape[2]
        return m[:, None].expand(m.shape[0], other, m.shape[1]).reshape(1, -1, m.shape[1])

    def _caption_mask(self, context_mask: torch.Tensor | None, context: torch.Tensor,
                      name: str) -> torch.Tensor | None:
        """``[B, 1, 1, L_text]`` bool, True at padding (Megatron's convention), or None."""
        if context_mask is None:
            return None
        batch, length = context.shape[1], context.shape[0]
        if context_mask.dtype != torch.bool or context_mask.shape != (batch, 1, 1, length):
            raise ValueError(f"{name}: context_mask must be a bool [B, 1, 1, L_text] = [{batch}, 1, 1, {length}] "
                             f"key-padding mask (True: padding), got {context_mask.dtype} "
                             f"{tuple(context_mask.shape)}")
        from dsp_plugin.megatron.core_attention import SDPACoreAttention

        if not isinstance(self.cross_attention.core_attention, SDPACoreAttention):
            raise ValueError(f"{name}: caption masks (context_mask) are implemented for --transformer-impl local "
                             "(SDPACoreAttention) only; Transformer Engine's padding masks are not wired yet")
        return context_mask

    def _bias_dropout(self, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Hidden dropout with this DSP shard's own mask (``dropout.py``), the same on its TP replicas."""
        if bias is not None:
            out = out + bias
        return sharded_dropout(out, self.hidden_dropout, self.training, salt=(self.pg_collection.cp.rank(),))



def _without_disabled_qk_norms(submodules: Any, config: DSPTransformerConfig) -> Any:
    """The spec names q/k norms; Megatron refuses them unless ``config.qk_layernorm``, so drop them then."""
    import dataclasses

    attention = getattr(submodules, "self_attention", None)
    inner = getattr(attention, "submodules", None)
    if config.qk_layernorm or inner is None or getattr(inner, "q_layernorm", None) is None:
        return submodules
    inner = dataclasses.replace(inner, q_layernorm=None, k_layernorm=None)
    return dataclasses.replace(submodules, self_attention=dataclasses.replace(attention, submodules=inner))
