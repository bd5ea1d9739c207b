"""DeepSpeed-Ulysses on the reference model, with DeepSpeed's own ``DistributedAttention``.

Layout (paper appendix A.2, as in OpenSora): the activation stays sharded on T.
Spatial blocks are local. In each temporal block DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention`` turns q, k, v from
sequence-sharded to head-sharded (3 all-to-alls), runs plain attention over the
full T for H/N heads, and turns the output back (1 all-to-all): 4 all-to-alls
per layer, 4 M (N-1)/N^2 bytes per device (paper Table 3: 4M/N).

Only the projection around the core attention is ours (the q/kv/proj Linear
modules of the block are reused, so parameter names do not change). The head
limit is DeepSpeed's: N must divide the head count; we check it up front so
the error names the numbers instead of failing inside a reshape or a
collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsp_plugin.baselines.common import (
    ShardState,
    check_heads,
    refuse_rope_and_masks,
    resolve_group,
    shard_on_time,
    sharded_blocks,
)

__all__ = ["UlyssesAttention", "parallelize_ulysses"]


def _deepspeed_comm_ready() -> None:
    """DistributedAttention talks through ``deepspeed.comm``; wrap the existing torch process group."""
    from dsp_plugin.deepspeed_env import skip_cpu_shm_build

    skip_cpu_shm_build()  # the CPU shared-memory op is for inference; building it costs 30-60 s
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)


class _LocalAttention(nn.Module):
    """The ``local_attention`` DeepSpeed calls: ``[B, L, H_local, d]`` q, k, v -> same shape."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [B, L, H, d] -> [B, H, L, d] for sdpa -> back
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


class UlyssesAttention(nn.Module):
    """Self-attention of a temporal block over a T-sharded input ``[rows, T/N, D]``."""

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads = attn.heads
        self.q, self.kv, self.proj = attn.q, attn.kv, attn.proj
        # batch-first q/k/v [rows, T/N, H, d]: scatter heads (dim 2), gather the sequence (dim 1)
        from deepspeed.sequence.layer import DistributedAttention

        self.dist_attn = DistributedAttention(_LocalAttention(), group, scatter_idx=2, gather_idx=1)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, angles: Any = None,
                key_mask: Any = None) -> torch.Tensor:
        refuse_rope_and_masks(type(self).__name__, angles, key_mask)
        if context is not None:
            raise ValueError("UlyssesAttention replaces self-attention only; got a context")
        rows, length, dim = x.shape
        q = self.q(x).view(rows, length, self.heads, -1)                         # [rows, T/N, H, d]
        k, v = self.kv(x).view(rows, length, 2, self.heads, -1).unbind(dim=2)   # [rows, T/N, H, d] each
        out = self.dist_attn(q, k, v, batch_dim_idx=0)                          # [rows, T/N, H, d]
        return self.proj(out.reshape(rows, length, dim))


def parallelize_ulysses(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model`` (an STDiT) on T and put DeepSpeed-Ulysses in its temporal blocks, in place."""
    group = resolve_group(group)
    n = dist.get_world_size(group)
    check_heads("ulysses", model.config.num_heads, n)
    _deepspeed_comm_ready()
    state: ShardState = shard_on_time(model, group=group, method="ulysses", require_even=True)
    for block in sharded_blocks(model):
        block.attn = UlyssesAttention(block.attn, group)
    model.sequence_state = state
    return model
