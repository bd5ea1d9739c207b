"""``SDPACoreAttention``: Megatron's core-attention contract over torch's fused SDPA kernel (CPU and GPU).

The local core attention of the DSP layers (``dsp_plugin.megatron.layers.dsp_layer_spec``); a module of its
own so that the layer (which checks for it) and the spec (which builds it) both import it without importing
each other.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from dsp_plugin.megatron.dropout import rank_dropout_attention

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Core attention ``softmax(q k^T / sqrt(d)) v`` with torch's fused SDPA kernel.

    ``attention_mask``: None, or a bool key-padding mask ``[b, 1, 1 | s_q, s_k]`` with
    True at masked keys (Megatron's convention; cross-attention's caption padding).

    Same constructor and forward contract as megatron-core's ``DotProductAttention``:
    q, k, v ``[s, b, heads_per_tp_rank, head_dim]`` -> ``[s, b, heads_per_tp_rank * head_dim]``.
    ``s`` is the dim the block attends along (spatial or temporal); ``b`` folds the
    batch with every other dim, which is why DSP may shard any of them freely.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention: the model's TransformerConfig must keep "
                             f"context_parallel_size=1 under DSP, got {config.context_parallel_size}")
        if attn_mask_type not in (AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"SDPACoreAttention: attn_mask_type={attn_mask_type} is not supported; "
                             "spatial-temporal blocks attend bidirectionally (no_mask)")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        # attention dropout: a mask per DSP shard and per TP rank (each holds other tokens or heads); dropout.py
        groups = [getattr(pg_collection, name, None) for name in ("cp", "tp")]
        self.dropout_salt = tuple(group.rank() if group is not None else 0 for group in groups)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: attention biases and packed sequences are not supported")
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4):
            raise ValueError("SDPACoreAttention: attention_mask must be a bool [b, 1, s_q | 1, s_k] mask (True: "
                             f"masked), got {attention_mask.dtype} {tuple(attention_mask.shape)}")
        # [s, b, h, d] -> [b, h, s, d]; grouped-query heads are expanded to the query count
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        mask = None if attention_mask is None else ~attention_mask
        if dropout:   # this shard's own mask (dropout.py); outside a compiled graph
            out = rank_dropout_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.softmax_scale,
                                         salt=self.dropout_salt)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        # [b, h, s, d] -> [s, b, h * d]
        return out.permute(2, 0, 1, 3).flatten(2)
