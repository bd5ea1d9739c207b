"""What the three baselines share: the activation stays sharded on T from input to output.

Paper appendix A.2: DeepSpeed-Ulysses, Megatron-SP and Ring attention all split
the sequence on the temporal dim and keep it there; they differ only in what
they do inside the blocks. So the entry and exit are the same as DSP's (the
core ``split`` before the patch embedder, the core ``gather`` before
unpatchify) and each baseline only swaps modules inside blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from dsp_plugin.comm import chunk_sizes, gather, split

__all__ = ["TIME_DIM", "ShardState", "check_heads", "refuse_rope_and_masks", "resolve_group", "shard_on_time",
           "sharded_blocks"]

#: token dim the baselines shard (tokens are ``[B, T, S, D]``); latents ``[B, C, T, H, W]`` split on dim 2
TIME_DIM = 1
_LATENT_TIME_DIM = 2


@dataclass
class ShardState:
    """Lengths of the forward in flight, written by the entry hook and read inside blocks."""

    group_size: int
    full_len: int = 0
    lengths: list[int] = field(default_factory=list)


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``None`` -> the DSP group of the current topology, else the whole world."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError("baselines need torch.distributed to be initialised")
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    return topology.dsp_group if topology is not None else dist.group.WORLD


def refuse_rope_and_masks(where: str, angles: Any = None, key_mask: Any = None) -> None:
    """The baselines reproduce the paper's plain STDiT: RoPE angles and caption masks are refused, not dropped."""
    if angles is not None or key_mask is not None:
        what = "RoPE angles" if angles is not None else "a caption key mask"
        raise ValueError(f"{where}: got {what}; the baselines run the paper's STDiT without RoPE and caption "
                         "masks (STDiTConfig temporal_rope/spatial_rope off, no text_mask)")


def check_heads(method: str, heads: int, n: int) -> None:
    """Ulysses and Megatron-SP shard attention heads: N must divide the head count."""
    if n > heads or heads % n:
        raise ValueError(f"{method}: {heads} attention heads cannot be sharded over {n} ranks "
                         f"(head limit: the group size must divide the head count, so at most {heads}); "
                         f"DSP and Ring attention have no such limit")


def shard_on_time(model: nn.Module, *, group: dist.ProcessGroup, method: str,
                  require_even: bool) -> ShardState:
    """Split the latents on T before ``model.embedder``; gather T before ``model.unpatchify``.

    ``require_even``: the method's collectives need equal chunks (Ulysses reshapes
    the sequence into N equal parts; Megatron all-gathers equal chunks), so an
    uneven T is refused here, on every rank, before any collective.
    """
    n = dist.get_world_size(group)
    state = ShardState(group_size=n)

    def entry(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        frames = args[0].shape[_LATENT_TIME_DIM]
        if frames < n:
            raise ValueError(f"{method}: T={frames} frames cannot be sharded over {n} ranks (needs T >= N)")
        if require_even and frames % n:
            raise ValueError(f"{method}: T={frames} frames is not divisible by the group size N={n}; "
                             f"{method} needs equal chunks (DSP and Ring attention accept uneven T)")
        state.full_len, state.lengths = frames, chunk_sizes(frames, n)
        return (split(args[0], _LATENT_TIME_DIM, group=group), *args[1:])

    def exit_(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (gather(args[0], TIME_DIM, group=group, global_len=state.full_len), *args[1:])

    model.embedder.register_forward_pre_hook(entry)
    model.unpatchify.register_forward_pre_hook(exit_)
    _global_time_positions(model, state, dist.get_rank(group))
    return state


def _global_time_positions(model: nn.Module, state: ShardState, rank: int) -> None:
    """Give T-sharded blocks the positions of their global frames.

    The reference block adds ``sincos(x.shape[attend_dim])`` itself, which is
    right only when the attended dim is whole (always so under DSP). Here the
    temporal blocks see T/N frames, so their own embedding is switched off and
    a pre-hook adds rows ``[offset, offset + T_rank)`` of the full-length table.
    """
    from dsp_plugin.models.stdit import sincos

    def add_positions(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        offset = sum(state.lengths[:rank])
        table = sincos(state.full_len, x.shape[-1], x.device, x.dtype)[offset:offset + x.shape[TIME_DIM]]
        shape = [1] * x.dim()
        shape[TIME_DIM], shape[-1] = x.shape[TIME_DIM], x.shape[-1]
        return (x + table.view(shape), *args[1:])

    for block in sharded_blocks(model):
        if block.add_pos_embed:
            block.add_pos_embed = False
            block.register_forward_pre_hook(add_positions)


def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks that attend along the sharded dim (temporal): the only ones that communicate."""
    return [block for block in model.blocks if block.attend_dim == TIME_DIM]
