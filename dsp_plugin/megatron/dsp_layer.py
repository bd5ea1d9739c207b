"""The DSP spatial-temporal layer: a megatron-core ``TransformerLayer`` that a stock ``TransformerBlock`` drives.

One layer of a video DiT (OpenSora / Latte family) with adaLN-Zero timestep
modulation and cross-attention to text. Shapes (``B`` batch, ``T`` frames,
``S`` patches, ``D`` hidden; ``_l`` a local DSP chunk; ``L_a`` the attended length)::

    in   [T_x * S_x, B, D]     Megatron's layout, tokens (t, s) row-major, one of T/S sharded
    ->   [B, T_x, S_x, D]      if sharded along the attend dim: dynamic_switch (one all-to-all)
    ->   adaLN: x + gate1 * SelfAttn(fold(norm(x) * (1 + scale1) + shift1))
         fold: [B, T, S_l, D] -> [T, B * S_l, D] (temporal) or [B, T_l, S, D] -> [S, B * T_l, D]
    ->   [T_x * S_x, B, D]     x + CrossAttn(norm(x), text)   (queries local, text replicated: no comm)
    ->   x + gate2 * MLP(norm(x) * (1 + scale2) + shift2)
    out  [T_x * S_x, B, D]     sharded on the dim this layer does not attend along

The conditioning travels the way ``TransformerBlock`` (and its full-recompute
path, ``checkpointed_forward``) hands tensors to layers: the timestep embedding
``c`` ``[B, D]`` in ``attention_mask`` (a DSP layer attends unmasked; NeMo's DiT
layers use the same slot) and the projected text ``[L_text, B, D]`` in
``context``. Geometry and the attend pattern come from the
:class:`~dsp_plugin.megatron.config.DSPTransformerConfig`, the DSP group from
``pg_collection.cp`` (parallel_state's CP slot).

Refused with a clear error: RoPE (positions along the attended dim would need the
full index, use ``dsp_sincos_positions``), masks, packed sequences, Megatron-SP,
and configs with ``context_parallel_size != 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from dsp_plugin.comm import dynamic_switch
from dsp_plugin.megatron.recompute import SwitchReplayCache, first_layer_of_a_chunk
from dsp_plugin.megatron.config import (
    ATTEND,
    FRAME_DIM,
    PATCH_DIM,
    DSPTransformerConfig,
    attend_dim,
    input_shard_dim,
    local_grid,
)

__all__ = ["DSPSpatialTemporalLayer", "sincos_positions"]


def sincos_positions(length: int, dim: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fixed sinusoidal positions ``[length, dim]`` (the plain-torch reference's ``sincos``)."""
    import math

    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1).to(dtype)


class DSPSpatialTemporalLayer(TransformerLayer):
    """A ``TransformerLayer`` that attends along one video dim and keeps the other DSP-sharded.

    Built from a ``ModuleSpec`` (``dsp_plugin.megatron.layers.dsp_layer_spec``);
    its submodules are Megatron's own (``SelfAttention``, ``CrossAttention``,
    ``MLP``, norms). The adaLN modulation ``SiLU -> Linear(D, 6D)`` is replicated
    over TP and zero-initialised (adaLN-Zero) when the config initialises weights.
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
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage, **kwargs)
        hidden = config.hidden_size
        self.adaln_modulation = nn.Linear(hidden, 6 * hidden, dtype=config.params_dtype,
                                          device="cpu" if config.use_cpu_initialization else None)
        if config.perform_initialization:  # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(self.adaln_modulation.weight)
            nn.init.zeros_(self.adaln_modulation.bias)
        self.attend_dim = attend_dim(config, self.layer_number)
        self.input_shard_dim = input_shard_dim(config, self.layer_number)
        pattern = config.dsp_attend_pattern
        first = [ATTEND[p] for p in pattern].index(self.attend_dim) + 1
        self.add_positions = config.dsp_sincos_positions and self.layer_number == first
        stage_offset = get_transformer_layer_offset(config, vp_stage, get_pg_rank(self.pg_collection.pp))
        self.switch_cache = (SwitchReplayCache()
                             if first_layer_of_a_chunk(config, self.layer_number - 1 - stage_offset) else None)

    # -- layout ------------------------------------------------------------------------------

    def _dsp(self) -> tuple[Any, int, int]:
        group = self.pg_collection.cp
        return group, group.size(), group.rank()

    def _to_grid(self, tokens: torch.Tensor, shard_dim: int) -> torch.Tensor:
        """``[T_x * S_x, B, D] -> [B, T_x, S_x, D]`` (T_x, S_x from the config and the shard)."""
        _, n, rank = self._dsp()
        frames, patches = local_grid(self.config, shard_dim, n, rank)
        if tokens.shape[0] != frames * patches:
            raise ValueError(f"{type(self).__name__} {self.layer_number}: got {tokens.shape[0]} local tokens, "
                             f"expected {frames} frames x {patches} patches sharded on dim {shard_dim} over "
                             f"{n} DSP ranks (config dsp_frames={self.config.dsp_frames}, "
                             f"dsp_patches={self.config.dsp_patches})")
        return tokens.view(frames, patches, tokens.shape[1], tokens.shape[2]).permute(2, 0, 1, 3)

    @staticmethod
    def _to_tokens(x: torch.Tensor) -> torch.Tensor:
        """``[B, T_x, S_x, D] -> [T_x * S_x, B, D]`` (a fresh tensor)."""
        return x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[3])

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
        if rotary_pos_emb is not None or rotary_pos_cos is not None or rotary_pos_cos_sin is not None:
            raise ValueError(f"{name}: rotary position embeddings are not supported under DSP (Megatron slices "
                             "them by context-parallel rank, which is not the DSP shard); use "
                             "dsp_sincos_positions or a positional table sliced by the shard")
        if packed_seq_params is not None or attention_bias is not None or context_mask is not None \
                or inference_context is not None:
            raise ValueError(f"{name}: packed sequences, attention biases, context masks and inference "
                             "contexts are not supported")
        cond = attention_mask
        if cond is None or cond.dim() != 2 or cond.shape != (hidden_states.shape[1], hidden_states.shape[2]):
            raise ValueError(f"{name}: attention_mask must carry the timestep embedding [B, D] = "
                             f"[{hidden_states.shape[1]}, {hidden_states.shape[2]}], got "
                             f"{None if cond is None else tuple(cond.shape)}")
        group, _, _ = self._dsp()
        x = self._to_grid(hidden_states, self.input_shard_dim)
        if self.input_shard_dim == self.attend_dim:  # S(attend) -> S(other): one all-to-all
            cur, tgt = self.attend_dim, FRAME_DIM + PATCH_DIM - self.attend_dim
            full = {FRAME_DIM: self.config.dsp_frames, PATCH_DIM: self.config.dsp_patches}
            if self.training and self.switch_cache is not None:  # full recompute: never replay the switch
                x = self.switch_cache.switch(hidden_states, x, cur, tgt, group=group, cur_full=full[cur],
                                             tgt_full=full[tgt])
            else:
                x = dynamic_switch(x, cur, tgt, group=group, global_len=full[cur])
        if self.add_positions:  # along the attended dim, which is never sharded: global positions
            length = x.shape[self.attend_dim]
            pos = sincos_positions(length, x.shape[-1], device=x.device, dtype=x.dtype)
            x = x + (pos[None, :, None] if self.attend_dim == FRAME_DIM else pos[None, None])
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            m[:, None, None] for m in self.adaln_modulation(nn.functional.silu(cond)).chunk(6, dim=-1))

        h = self.input_layernorm(x) * (1 + scale1) + shift1
        out, bias = self.self_attention(self._fold(h), attention_mask=None)
        x = x + gate1 * self._unfold(self._bias_dropout(out, bias), x)

        tokens = self._to_tokens(x)  # [T_x * S_x, B, D]
        if context is not None and not isinstance(self.cross_attention, IdentityOp):
            out, bias = self.cross_attention(self.pre_cross_attn_layernorm(tokens), attention_mask=None,
                                             key_value_states=context)
            tokens = tokens + self._bias_dropout(out, bias)
        shift2, scale2, gate2 = (m[:, :, 0].transpose(0, 1) for m in (shift2, scale2, gate2))  # [1, B, D]
        h = self.pre_mlp_layernorm(tokens) * (1 + scale2) + shift2
        out, bias = self.mlp(h)
        return tokens + gate2 * self._bias_dropout(out, bias), context

    def _bias_dropout(self, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:
            out = out + bias
        return nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)

