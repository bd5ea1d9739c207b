"""Entry and exit of a DSP layer stack in a user's own megatron-core model.

A model that drives :class:`~dsp_plugin.megatron.dsp_layer.DSPSpatialTemporalLayer`s
through a ``TransformerBlock`` needs three things around the block:

- :func:`split_video_tokens`: ``[B, T, S, D]`` replicated -> this rank's
  ``[T_x * S_x, B, D]`` (Megatron's layout), sharded where layer 1 wants it;
- :func:`gather_video_tokens`: the block's output -> ``[B, T, S, D]`` on every rank
  (or keep it sharded and compute a per-token loss on the shard, as ``steps.loss_func`` does);
- :func:`require_dsp_layers`: under ``--sequence-parallel-mode dsp`` a model with no DSP
  layer would silently run as plain context parallelism; this refuses it.

Positional information: a table over the *sharded* dim must be sliced by the shard
(:func:`shard_range`); RoPE is refused by the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from dsp_plugin.comm import chunk_sizes, gather, split
from dsp_plugin.megatron.config import FRAME_DIM, DSPTransformerConfig, entry_shard_dim, output_shard_dim

__all__ = ["gather_video_tokens", "require_dsp_layers", "shard_range", "split_video_tokens"]


def split_video_tokens(x: torch.Tensor, config: DSPTransformerConfig, *, group: object = None) -> torch.Tensor:
    """``[B, T, S, D]`` (same on every DSP rank) -> ``[T_x * S_x, B, D]``, this rank's shard for layer 1.

    The backward is a gather, so gradients reach a replicated input correctly.
    """
    if x.dim() != 4 or (x.shape[1], x.shape[2]) != (config.dsp_frames, config.dsp_patches):
        raise ValueError(f"split_video_tokens: expected [B, T={config.dsp_frames}, S={config.dsp_patches}, D], "
                         f"got {tuple(x.shape)}")
    x = split(x, entry_shard_dim(config), group=group)
    return x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[3])  # [B, T_x, S_x, D] -> [T_x*S_x, B, D]


def gather_video_tokens(tokens: torch.Tensor, config: DSPTransformerConfig, *, group: object = None,
                        after_layer: int | None = None) -> torch.Tensor:
    """Output of layer ``after_layer`` (default: the last) ``[T_x * S_x, B, D]`` -> ``[B, T, S, D]``."""
    from dsp_plugin.comm import group_rank, group_size

    shard = output_shard_dim(config, config.num_layers if after_layer is None else after_layer)
    n, rank = group_size(group), group_rank(group)
    frames, patches = config.dsp_frames, config.dsp_patches
    if shard == FRAME_DIM:
        frames = chunk_sizes(frames, n)[rank]
    else:
        patches = chunk_sizes(patches, n)[rank]
    x = tokens.view(frames, patches, tokens.shape[1], tokens.shape[2]).permute(2, 0, 1, 3)
    full = config.dsp_frames if shard == FRAME_DIM else config.dsp_patches
    return gather(x.contiguous(), shard, group=group, global_len=full)


def shard_range(config: DSPTransformerConfig, dim: int, dsp_size: int, dsp_rank: int) -> slice:
    """The slice of dim ``dim`` (1 = T, 2 = S) that a DSP rank holds: slice positional tables with it."""
    full = config.dsp_frames if dim == FRAME_DIM else config.dsp_patches
    sizes = chunk_sizes(full, dsp_size)
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
