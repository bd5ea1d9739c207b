"""Rotary tables of the DSP layers: 1-D along an attended dim, 2-D over the patch grid, 3-D in full layers.

Every table is Megatron's non-interleaved ``[L, 1, 1, head_dim]`` of *angles*
(``cat([f, f], -1)`` with ``f [L, head_dim / 2]``, the pair ``(i, i + d/2)`` of a
head's dims rotated by ``f[:, i]``), applied by Megatron's own
``apply_rotary_pos_emb`` (fused with Transformer Engine). :func:`video_rope` builds,
from a batch's global ``(T, H, W)``, the ``rotary_pos_emb`` pair
``(frames, patches)`` that ``TransformerBlock`` hands to every layer (also through
full recompute, which carries exactly a pair of tensors):

- factorized layers attend along a dim DSP never shards, so their table covers the
  global length of that dim on every rank: temporal layers rotate by the frame index
  (all ``d/2`` pairs), spatial layers (``dsp_spatial_rope``) by the patch row (the first
  ``d/4`` pairs) and column (the next ``d/4``);
- full layers attend over all ``T * S`` tokens, and a rank holds the tokens of its
  shard (``T_x`` frames x all ``S`` patches, or all ``T`` frames x ``S_x`` patches).
  Their 3-D RoPE (Wan's and NVIDIA's video models' split) gives the first
  ``d/2 - 2 * (d // 6)`` pairs to the frame index, the next ``d // 6`` to the patch
  row and the last ``d // 6`` to the column, each axis with its own frequencies
  ``base^(-j / pairs_of_the_axis)``. Each pair is rotated by exactly one axis, so the
  angles of token ``(t, s)`` are the sum ``A[t] + B[s]`` of a per-frame table ``A``
  (zero outside the frame pairs) and a per-patch table ``B`` (zero outside the row
  and column pairs): :func:`full_layer_table` takes the rows of this rank's global
  ``t`` and ``s`` and adds them, ``[T_x * S_x, 1, 1, d]`` in the layer's token order.

With full layers in the pattern each table of the pair is ``[L, 1, 2, d]``: slot 0 the
factorized layers' table along that dim (zeros, the identity rotation, for patches
without ``dsp_spatial_rope``), slot 1 the full layers' ``A`` or ``B``. Without full
layers the pair is ``[L, 1, 1, d]`` (``patches`` None without ``dsp_spatial_rope``).
"""

from __future__ import annotations

import torch

from dsp_plugin.megatron.config import FRAME_DIM, PATCH_DIM, DSPTransformerConfig, rope_dims

__all__ = ["factorized_table", "full_layer_table", "full_rope_pairs", "video_rope"]


def full_rope_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotated pairs of a full layer's 3-D RoPE for ``(frames, rows, columns)``: ``d/2 - 2 * (d // 6)``,
    ``d // 6``, ``d // 6`` (Wan's split of a head's dims)."""
    spatial = head_dim // 6
    return head_dim // 2 - 2 * spatial, spatial, spatial


def _angles(positions: torch.Tensor, pairs: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32, device=positions.device)
                              / (2 * pairs))  # Megatron's RotaryEmbedding.inv_freq for dim 2 * pairs
    return torch.outer(positions.float(), inv_freq)


def _table(freqs: torch.Tensor) -> torch.Tensor:
    """``[L, d/2]`` angles -> Megatron's non-interleaved ``[L, 1, 1, d]``."""
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def video_rope(config: DSPTransformerConfig, frames: int, height: int, width: int, *,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``rotary_pos_emb`` for a ``TransformerBlock`` of DSP layers: the ``(frames, patches)`` tables over the
    **global** frame index and patch ``(row, column)`` (module docstring), or None without RoPE."""
    dims = rope_dims(config)
    if not dims:
        return None
    head_dim, base = config.kv_channels, float(config.rotary_base)
    frame, patch = torch.arange(frames, device=device), torch.arange(height * width, device=device)
    temporal = _table(_angles(frame, head_dim // 2, base))
    spatial = None
    if PATCH_DIM in dims:  # 2-D: the first half of the pairs by row, the second by column
        spatial = _table(torch.cat([_angles(patch // width, head_dim // 4, base),
                                    _angles(patch % width, head_dim // 4, base)], dim=-1))
    if "full" not in config.dsp_attend_pattern:
        return temporal, spatial
    t_pairs, h_pairs, w_pairs = full_rope_pairs(head_dim)
    per_frame = torch.zeros(frames, head_dim // 2, device=device)
    per_frame[:, :t_pairs] = _angles(frame, t_pairs, base)
    per_patch = torch.zeros(height * width, head_dim // 2, device=device)
    per_patch[:, t_pairs:t_pairs + h_pairs] = _angles(patch // width, h_pairs, base)
    per_patch[:, t_pairs + h_pairs:] = _angles(patch % width, w_pairs, base)
    if spatial is None:
        spatial = torch.zeros_like(_table(per_patch))  # no spatial RoPE: the identity rotation (never applied)
    return torch.cat([temporal, _table(per_frame)], dim=2), torch.cat([spatial, _table(per_patch)], dim=2)


def factorized_table(rotary_pos_emb: object, dim: int, length: int, where: str) -> torch.Tensor:
    """The table of a layer attending along ``dim`` (``FRAME_DIM``/``PATCH_DIM``), ``[length, 1, 1, d]``."""
    table = _pick(rotary_pos_emb, 0 if dim == FRAME_DIM else 1, where)
    if table is None or table.dim() != 4 or table.shape[0] != length:
        raise ValueError(f"{where}: the rotary table for dim {dim} must be [{length}, 1, 1 | 2, head_dim] (the "
                         f"global length of the attended dim), got {None if table is None else tuple(table.shape)}")
    return table[:, :, :1]


def full_layer_table(rotary_pos_emb: object, grid: tuple[int, int], frames: slice, patches: slice,
                     where: str) -> torch.Tensor:
    """A full layer's 3-D table ``[T_x * S_x, 1, 1, d]`` for the tokens it holds: global frames ``frames`` x
    global patches ``patches`` of ``grid = (T, S)``, row-major (the layer's token order)."""
    tables = [_pick(rotary_pos_emb, i, where) for i in (0, 1)]
    for table, length, what in zip(tables, grid, ("frames", "patches"), strict=True):
        if table is None or table.dim() != 4 or table.shape[0] != length or table.shape[2] != 2:
            raise ValueError(f"{where}: a full layer's 3-D RoPE needs the {what} table [{length}, 1, 2, head_dim] "
                             "of video_rope for a config with full layers, got "
                             f"{None if table is None else tuple(table.shape)}")
    per_frame, per_patch = tables[0][frames, :, 1:], tables[1][patches, :, 1:]  # [T_x, 1, 1, d], [S_x, 1, 1, d]
    return (per_frame[:, None] + per_patch[None]).flatten(0, 1)  # angles add: each pair rotates by one axis


def _pick(rotary_pos_emb: object, index: int, where: str) -> torch.Tensor | None:
    if not isinstance(rotary_pos_emb, (tuple, list)) or len(rotary_pos_emb) != 2:
        raise ValueError(f"{where}: position_embedding_type='rope' needs rotary_pos_emb = the (frames, patches) "
                         f"tables of tokens.video_rope, got {type(rotary_pos_emb).__name__}")
    return rotary_pos_emb[index]
