"""What a DSP spatial-temporal layer reads from its ``TransformerConfig``: the video geometry and the pattern.

Activations between layers are Megatron's ``[tokens_local, B, D]``, where the
token dim is the row-major flattening of ``(T, S)`` (``T`` frames, ``S`` patches
per frame) with **one** of the two sharded over the DSP group. Which one is a
function of the layer pattern alone, so nothing but the tensor travels:

- layer ``k`` (1-based, global over pipeline stages) attends along
  ``dsp_attend_pattern[(k - 1) % len(pattern)]`` (``"spatial"``: S, ``"temporal"``: T);
- it leaves its output sharded on the dim it does **not** attend along;
- so layer ``k`` receives the shard of ``other(attend(k - 1))``, and layer 1 the
  shard the model entry splits on, ``other(attend(1))`` (:func:`entry_shard_dim`).
- a ``"full"`` layer attends over all ``T * S`` tokens through the head switch
  (``dsp_plugin.megatron.full_attention``) and keeps its input's shard; the entry
  shard is then set by the first factorized layer of the pattern (T if none).

A layer whose input is sharded along its own attend dim switches first (one
all-to-all, ``global_len`` from this config: no collective to learn lengths).
Dims are those of the token tensor ``[B, T, S, D]``: :data:`FRAME_DIM` = 1, :data:`PATCH_DIM` = 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["ATTEND", "FRAME_DIM", "FULL", "PATCH_DIM", "DSPTransformerConfig", "attend_dim", "entry_shard_dim",
           "input_shard_dim", "output_shard_dim", "local_grid"]

FRAME_DIM, PATCH_DIM = 1, 2  # dims of the token tensor [B, T, S, D]
FULL = None  # a "full" layer attends along no single dim: every token, heads switched (full_attention.py)
ATTEND: dict[str, int | None] = {"spatial": PATCH_DIM, "temporal": FRAME_DIM, "full": FULL}


@dataclass
class DSPTransformerConfig(TransformerConfig):
    """megatron-core's ``TransformerConfig`` plus the video geometry DSP layers need.

    ``context_parallel_size`` stays 1: the DSP group sits in parallel_state's CP
    slot (``pg_collection.cp``), but attention must stay local.
    """

    dsp_frames: int = 0
    """Latent frames T of one sample (global length of the temporal dim)."""

    dsp_patches: int = 0
    """Patches S per frame (global length of the spatial dim)."""

    dsp_attend_pattern: tuple[str, ...] = ("spatial", "temporal")
    """Attend dim of layer k is ``pattern[(k - 1) % len(pattern)]``."""

    dsp_sincos_positions: bool = True
    """The first layer attending along each dim adds fixed sin-cos positions along it (never sharded)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dsp_frames < 1 or self.dsp_patches < 1:
            raise ValueError(f"DSPTransformerConfig: dsp_frames ({self.dsp_frames}) and dsp_patches "
                             f"({self.dsp_patches}) must be positive: the video geometry of one sample")
        bad = [p for p in self.dsp_attend_pattern if p not in ATTEND]
        if not self.dsp_attend_pattern or bad:
            raise ValueError(f"DSPTransformerConfig: dsp_attend_pattern={self.dsp_attend_pattern!r}; "
                             f"expected a non-empty tuple of {sorted(ATTEND)}")
        if self.context_parallel_size != 1:
            raise ValueError("DSPTransformerConfig: context_parallel_size must be 1 (attention stays local; the "
                             f"DSP group occupies parallel_state's CP slot), got {self.context_parallel_size}")


def attend_dim(config: DSPTransformerConfig, layer_number: int) -> int | None:
    """Token dim layer ``layer_number`` (1-based, global) attends along; ``FULL`` (None) for a full layer."""
    pattern = config.dsp_attend_pattern
    return ATTEND[pattern[(layer_number - 1) % len(pattern)]]


def _other(dim: int) -> int:
    return FRAME_DIM + PATCH_DIM - dim


def output_shard_dim(config: DSPTransformerConfig, layer_number: int) -> int:
    """Sharded dim of layer ``layer_number``'s output: the one it does not attend along (a full layer: its input's)."""
    for k in range(layer_number, 0, -1):  # full layers keep the shard they receive
        attended = attend_dim(config, k)
        if attended is not FULL:
            return _other(attended)
    return entry_shard_dim(config)


def entry_shard_dim(config: DSPTransformerConfig) -> int:
    """Where the model entry splits the tokens: the first factorized layer then runs without a switch."""
    factorized = [ATTEND[kind] for kind in config.dsp_attend_pattern if ATTEND[kind] is not FULL]
    return _other(factorized[0]) if factorized else FRAME_DIM


def input_shard_dim(config: DSPTransformerConfig, layer_number: int) -> int:
    """Sharded dim of the activation entering layer ``layer_number``."""
    return entry_shard_dim(config) if layer_number <= 1 else output_shard_dim(config, layer_number - 1)


def local_grid(config: DSPTransformerConfig, shard_dim: int, dsp_size: int, dsp_rank: int) -> tuple[int, int]:
    """``(frames, patches)`` this DSP rank holds when the tokens are sharded on ``shard_dim``."""
    from dsp_plugin.comm import chunk_sizes

    frames, patches = config.dsp_frames, config.dsp_patches
    if shard_dim == FRAME_DIM:
        return chunk_sizes(frames, dsp_size)[dsp_rank], patches
    return frames, chunk_sizes(patches, dsp_size)[dsp_rank]
