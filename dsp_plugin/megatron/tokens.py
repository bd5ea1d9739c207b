"""Entry and exit of a DSP layer stack in a user's own megatron-core model.

A model that drives :class:`~dsp_plugin.megatron.dsp_layer.DSPSpatialTemporalLayer`s
through a ``TransformerBlock`` needs, around the block:

- :func:`split_video_tokens`: ``[B, T, S, D]`` replicated -> this rank's
  ``[T_x * S_x, B, D]`` (Megatron's layout), sharded where layer 1 wants it and
  tagged with its global ``(T, S)`` (a :class:`~dsp_plugin.layout.ShardSpec`):
  frames and resolution may differ from batch to batch;
- :func:`gather_video_tokens`: the block's output -> ``[B, T, S, D]`` on every rank
  (or keep it sharded and compute a per-token loss on the shard, as ``steps.loss_func`` does);
- :func:`video_rope` (from ``rope.py``): with ``position_embedding_type="rope"``, the
  ``rotary_pos_emb`` pair for the block, over the global frame and patch indices;
- :func:`require_dsp_layers`: under ``--sequence-parallel-mode dsp`` a model with no DSP
  layer would silently run as plain context parallelism; this refuses it.

A learned positional table over the *sharded* dim must be sliced by the shard
(:func:`shard_range`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsp_plugin.comm import chunk_sizes, gather, split
from dsp_plugin.megatron.config import FRAME_DIM, DSPTransformerConfig, entry_shard_dim, output_shard_dim
from dsp_plugin.megatron.dsp_layer import attach_video_grid, video_grid
from dsp_plugin.megatron.rope import video_rope

__all__ = ["gather_video_tokens", "require_dsp_layers", "shard_range", "split_video_tokens", "video_rope"]


def split_video_tokens(x: torch.Tensor, config: DSPTransformerConfig, *, group: object = None) -> torch.Tensor:
    """``[B, T, S, D]`` (same on every DSP rank) -> ``[T_x * S_x, B, D]``, this rank's shard for layer 1,
    tagged with the global ``(T, S)``. The backward is a gather, so gradients reach a replicated input."""
    if x.dim() != 4:
        raise ValueError(f"split_video_tokens: expected [B, T, S, D], got {tuple(x.shape)}")
    grid, shard = (x.shape[1], x.shape[2]), entry_shard_dim(config)
    x = split(x, shard, group=group)
    # [B, T_x, S_x, D] -> [T_x*S_x, B, D], contiguous as Megatron's hidden states are (its checkpoint with
    # --distribute-saved-activations flattens them)
    tokens = x.permute(1, 2, 0, 3).contiguous().view(-1, x.shape[0], x.shape[3])
    return attach_video_grid(tokens, grid, shard)


def gather_video_tokens(tokens: torch.Tensor, config: DSPTransformerConfig, *, group: object = None,
                        after_layer: int | None = None) -> torch.Tensor:
    """Output of layer ``after_layer`` (default: the last) ``[T_x * S_x, B, D]`` -> ``[B, T, S, D]``;
    the global ``(T, S)`` come from the tag the layers attach."""
    from dsp_plugin.comm import group_rank, group_size
    from dsp_plugin.megatron.config import local_grid

    grid, shard = video_grid(tokens, "gather_video_tokens")
    expected = output_shard_dim(config, config.num_layers if after_layer is None else after_layer)
    if shard != expected:
        raise ValueError(f"gather_video_tokens: the tokens are sharded on dim {shard}, layer "
                         f"{after_layer or config.num_layers} leaves dim {expected}")
    frames, patches = local_grid(grid, shard, group_size(group), group_rank(group))
    x = tokens.view(frames, patches, tokens.shape[1], tokens.shape[2]).permute(2, 0, 1, 3)
    return gather(x.contiguous(), shard, group=group, global_len=grid[shard - FRAME_DIM])


def shard_range(length: int, dsp_size: int, dsp_rank: int) -> slice:
    """The slice of a sharded dim of global ``length`` that a DSP rank holds: slice positional tables with it."""
    sizes = chunk_sizes(length, dsp_size)
    start = sum(sizes[:dsp_rank])
    return slice(start, start + sizes[dsp_rank])


def require_dsp_layers(model: nn.Module) -> None:
    """Raise unless ``model`` contains a DSP layer (see the module docstring)."""
    from dsp_plugin.megatron.dsp_layer import DSPSpatialTemporalLayer

    if not any(isinstance(m, DSPSpatialTemporalLayer) for m in model.modules()):
        raise ValueError(f"--sequence-parallel-mode dsp: the model ({type(model).__name__}) has no "
                         "DSPSpatialTemporalLayer, so the DSP group would only act as Megatron context "
                         "parallelism; build its layers with dsp_plugin.megatron.dsp_layer_spec() "
                         "(docs/megatron.md, 'Your own model') or use --context-parallel-size")
