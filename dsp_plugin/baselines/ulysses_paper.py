"""DeepSpeed-Ulysses as the paper's benchmark harness ran it: all-to-alls around EVERY attention.

The paper's harness (first author's fork ``oahzxl/OpenDiT``, branch ``exp``,
commit 86869cd) shards the activation on T like ``ulysses`` does, but:

* the **spatial** self-attention also turns q, k, v from sequence-sharded to
  head-sharded and the output back (``opendit/modules/attn.py`` L270-313, called
  with ``dim=0`` from ``stdit.py`` L125), although under a T shard spatial
  attention is local: the all-to-all gathers the frames (the rows of
  ``[B*T/N, S, H, d]``) and scatters the heads;
* the **cross-attention** to the text all-to-alls the query, the text keys and
  values and the output (``attn.py`` L371-414). The keys and values are the same
  on every rank, so each rank attends to N copies of the text, which gives the
  same result as one copy;
* every all-to-all is a separate list-based call with two copies
  (``opendit/core/comm.py`` L209-215; see ``comm.paper_all_to_all``).

In this repo's reference block every block (spatial and temporal) has its own
cross-attention, so a layer here makes 4 + 4 self-attention all-to-alls plus
2 x (q, k, v, o) cross-attention ones: 12 activation-sized and 4 text-sized
calls, where OpenSora's STDiT block (one cross-attention per layer) makes 10
and 2. The best-practice variant, only in the temporal block, is ``ulysses``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsp_plugin.baselines.comm import paper_all_to_all
from dsp_plugin.baselines.common import (
    TIME_DIM,
    ShardState,
    check_heads,
    refuse_rope_and_masks,
    resolve_group,
    shard_on_time,
)

__all__ = ["PaperCrossAttention", "PaperSelfAttention", "parallelize_ulysses_paper"]

_HEADS = 2  # q, k, v are [rows, L, H, d]: heads are dim 2


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[rows, L, H, d]`` q and ``[rows, L_kv, H, d]`` k, v -> ``[rows, L, H, d]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class PaperSelfAttention(nn.Module):
    """Self-attention of a spatial (``seq_dim=0``: frames in the rows) or temporal (``seq_dim=1``) block.

    ``seq_dim`` is where this rank's T chunk sits in ``[rows, L, H, d]``: the
    all-to-all gathers it and scatters the heads; the output goes back the same way.
    """

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, seq_dim: int) -> None:
        super().__init__()
        self.heads = attn.heads
        self.q, self.kv, self.proj = attn.q, attn.kv, attn.proj
        self.group, self.seq_dim = group, seq_dim

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: Any = None,
                key_mask: Any = None) -> torch.Tensor:
        refuse_rope_and_masks(type(self).__name__, angles, key_mask)
        if context is not None:
            raise ValueError("PaperSelfAttention replaces self-attention only; got a context")
        rows, length, dim = x.shape
        q = self.q(x).view(rows, length, self.heads, -1)                        # [rows, L, H, d]
        k, v = self.kv(x).view(rows, length, 2, self.heads, -1).unbind(dim=2)   # [rows, L, H, d] each
        # three separate calls, as the harness makes them: [.., H, d] -> [.., H/N, d], T gathered
        q, k, v = (paper_all_to_all(t, _HEADS, self.seq_dim, group=self.group) for t in (q, k, v))
        out = _attend(q, k, v)
        out = paper_all_to_all(out, self.seq_dim, _HEADS, group=self.group)     # back to [rows, L, H, d]
        return self.proj(out.reshape(rows, length, dim))


class PaperCrossAttention(nn.Module):
    """Cross-attention of every token of the shard to its sample's text, heads sharded by all-to-alls."""

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads = attn.heads
        self.q, self.kv, self.proj = attn.q, attn.kv, attn.proj
        self.group = group

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: Any = None,
                key_mask: Any = None) -> torch.Tensor:
        refuse_rope_and_masks(type(self).__name__, angles, key_mask)
        if context is None:
            raise ValueError("PaperCrossAttention needs the text context")
        b, length, dim = x.shape                                                 # [B, T/N * S, D]
        q = self.q(x).view(b, length, self.heads, -1)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).unbind(dim=2)
        q = paper_all_to_all(q, _HEADS, 1, group=self.group)                     # [B, T*S, H/N, d]
        # [B, L_text, H, d] -> [B, N*L_text, H/N, d]: N copies of the same text, same softmax
        k, v = (paper_all_to_all(t.contiguous(), _HEADS, 1, group=self.group) for t in (k, v))
        out = paper_all_to_all(_attend(q, k, v), 1, _HEADS, group=self.group)
        return self.proj(out.reshape(b, length, dim))


def parallelize_ulysses_paper(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` (an STDiT) on T and put the harness's Ulysses in every attention, in place."""
    group = resolve_group(group)
    n = dist.get_world_size(group)
    check_heads("ulysses_paper", model.config.num_heads, n)
    state: ShardState = shard_on_time(model, group=group, method="ulysses_paper", require_even=True)
    for block in model.blocks:
        block.attn = PaperSelfAttention(block.attn, group, seq_dim=1 if block.attend_dim == TIME_DIM else 0)
        if block.cross is not None:
            block.cross = PaperCrossAttention(block.cross, group)
    model.sequence_state = state
    return model
