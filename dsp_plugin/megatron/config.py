"""What a DSP spatial-temporal layer reads from its ``TransformerConfig``: the pattern and the model's features.

The video geometry is **not** here: frames and resolution may change from batch
to batch. The global lengths travel with the batch: the model entry tags the
hidden states with a :class:`~dsp_plugin.layout.ShardSpec` (``grid=(T, S)``,
``axis`` the sharded one) that every layer reads and re-tags, and where a tag
cannot travel (pipeline P2P) each stage reads them from its own batch.

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
all-to-all, ``global_len`` from the tag: no collective to learn lengths).
Dims are those of the token tensor ``[B, T, S, D]``: :data:`FRAME_DIM` = 1, :data:`PATCH_DIM` = 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["ATTEND", "FRAME_DIM", "FULL", "PATCH_DIM", "POSITION_EMBEDDINGS", "DSPTransformerConfig", "attend_dim",
           "entry_shard_dim", "input_shard_dim", "output_shard_dim", "local_grid", "rope_dims"]

FRAME_DIM, PATCH_DIM = 1, 2  # dims of the token tensor [B, T, S, D]
FULL = None  # a "full" layer attends along no single dim: every token, heads switched (full_attention.py)
ATTEND: dict[str, int | None] = {"spatial": PATCH_DIM, "temporal": FRAME_DIM, "full": FULL}
#: ``--position-embedding-type`` values a DSP model takes: fixed sin-cos tables along each attended dim
#: (Megatron's default name), RoPE (temporal; 2-D spatial with ``dsp_spatial_rope``), or none
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass
class DSPTransformerConfig(TransformerConfig):
    """megatron-core's ``TransformerConfig`` plus the attend pattern and the video DiT's features.

    ``context_parallel_size`` stays 1: the DSP group sits in parallel_state's CP
    slot (``pg_collection.cp``), but attention must stay local.
    """

    dsp_attend_pattern: tuple[str, ...] = ("spatial", "temporal")
    """Attend dim of layer k is ``pattern[(k - 1) % len(pattern)]``."""

    dsp_sincos_positions: bool = True
    """The first layer attending along each dim adds fixed sin-cos positions along it (never sharded),
    unless RoPE covers that dim."""

    position_embedding_type: str = "learned_absolute"
    """Megatron's ``--position-embedding-type``: ``"rope"`` rotates q and k of temporal layers by each
    token's frame index (OpenSora 1.2) and of full layers by its global (frame, row, column) (3-D RoPE,
    ``rope.py``); ``"learned_absolute"`` (the default name) keeps the sin-cos tables."""

    rotary_base: float = 10000.0
    """Megatron's ``--rotary-base``."""

    dsp_spatial_rope: bool = False
    """With RoPE: spatial layers too, 2-D (half the rotated pairs by patch row, half by column)."""

    dsp_adaln_single: bool = False
    """PixArt / OpenSora adaLN-single: the model maps the timestep once to ``[B, 6D]`` and each layer
    adds its learned ``scale_shift_table [6, D]`` (instead of a per-layer adaLN linear)."""

    dsp_comm_dtype: str | None = None
    """Megatron's ``--dsp-comm-dtype``: ``"fp8"`` sends every switch and head switch (forward and backward) as
    float8 e4m3 with a float32 scale per chunk (``dsp_plugin.comm.payload``); None: the activations' dtype."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dsp_comm_dtype not in (None, "fp8"):
            raise ValueError(f"DSPTransformerConfig: dsp_comm_dtype={self.dsp_comm_dtype!r}; expected None (the "
                             f"activations' dtype) or 'fp8'")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"DSPTransformerConfig: position_embedding_type={self.position_embedding_type!r}; "
                             f"DSP layers take one of {POSITION_EMBEDDINGS}")
        head_dim = self.kv_channels or self.hidden_size // self.num_attention_heads
        need = 4 if self.dsp_spatial_rope else 2
        if self.position_embedding_type == "rope" and head_dim % need:
            raise ValueError(f"DSPTransformerConfig: RoPE needs the head dim ({head_dim}) divisible by {need}"
                             f"{' (2-D spatial RoPE)' if self.dsp_spatial_rope else ''}")
        if self.dsp_spatial_rope and self.position_embedding_type != "rope":
            raise ValueError("DSPTransformerConfig: dsp_spatial_rope needs position_embedding_type='rope', got "
                             f"{self.position_embedding_type!r}")
        bad = [p for p in self.dsp_attend_pattern if p not in ATTEND]
        if not self.dsp_attend_pattern or bad:
            raise ValueError(f"DSPTransformerConfig: dsp_attend_pattern={self.dsp_attend_pattern!r}; "
                             f"expected a non-empty tuple of {sorted(ATTEND)}")
        if self.position_embedding_type == "rope" and "full" in self.dsp_attend_pattern and head_dim < 6:
            raise ValueError(f"DSPTransformerConfig: position_embedding_type='rope' with full-attention layers "
                             f"(dsp_attend_pattern={self.dsp_attend_pattern!r}) rotates a head's pairs by frame, "
                             f"patch row and column (3-D RoPE, head_dim // 6 pairs each for row and column), so it "
                             f"needs a head dim >= 6, got {head_dim}")
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


def rope_dims(config: DSPTransformerConfig) -> tuple[int, ...]:
    """Token dims whose attention uses RoPE (none unless ``position_embedding_type == "rope"``)."""
    if config.position_embedding_type != "rope":
        return ()
    return (FRAME_DIM, PATCH_DIM) if config.dsp_spatial_rope else (FRAME_DIM,)


def local_grid(grid: tuple[int, int], shard_dim: int, dsp_size: int, dsp_rank: int) -> tuple[int, int]:
    """``(frames, patches)`` this DSP rank holds of the global ``grid = (T, S)`` sharded on ``shard_dim``."""
    from dsp_plugin.comm import chunk_sizes

    frames, patches = grid
    if shard_dim == FRAME_DIM:
        return chunk_sizes(frames, dsp_size)[dsp_rank], patches
    return frames, chunk_sizes(patches, dsp_size)[dsp_rank]
