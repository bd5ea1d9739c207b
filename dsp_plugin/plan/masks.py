"""An attention mask inside a ``Heads`` module, laid out for the attention after the head switch.

After the switch each rank attends with its heads over the WHOLE sequence: the
kernel sees ``Lq = Lk = R + L`` tokens (``R`` replicated joint tokens, ``L`` the
global sequence), exactly the lengths of the one-process call, and ``h_r`` of
the ``H`` heads. So a mask the model built for the global sequence is already
right for the local kernel, bit for bit, and is passed on unchanged; only a head
dim of size ``H`` is narrowed to this rank's heads. Mask dims are read the way
``scaled_dot_product_attention`` broadcasts them against ``[B, H, Lq, Lk]``, from
the right (diffusers' backends read 4-D masks the same way; a 2-D ``[B, Lk]``
key-padding mask is converted by the backend itself, alike on every rank):

==========================  ===============================================
``[Lk]``                    a bias over keys
``[Lq | 1 | B, Lk]``        a 2-D mask (SDPA: ``[Lq, Lk]``; diffusers: ``[B, Lk]``)
``[H | 1, Lq | 1, Lk]``     3-D: per head (narrowed) or shared
``[B | 1, H | 1, Lq | 1, Lk]``  4-D: key padding ``[B, 1, 1, Lk]`` (HunyuanVideo's text
                            mask), causal blocks ``[1, 1, Lq, Lk]``, per-head biases
==========================  ===============================================

A mask built from the tokens this rank holds (``R + L_local`` keys) is refused:
it broadcasts silently when ``R + L_local == 1`` and fails with a different size
on each rank otherwise. So is a key dim that is not ``Lk`` (no broadcasting over
keys: a length-1 key dim is how a local mask with one token per rank looks).
A flex ``BlockMask`` passes when it was built for ``(Lq, Lk)`` and one head.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_mask", "place_mask"]


def _block_mask_type() -> type | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch < 2.5
        return None
    return BlockMask


def _expected(batch: int, heads: int, queries: int, keys: int) -> str:
    return (f"a mask for the global sequence: last dim {keys} keys, then from the right {queries} queries or 1, "
            f"{heads} heads or 1, {batch} samples or 1")


def check_mask(where: str, mask: Any, *, batch: int, heads: int, queries: int, keys: int,
               local_keys: int) -> str | None:
    """Why ``mask`` cannot be placed for the switched attention (None: it can); no collective, no copy."""
    if mask is None:
        return None
    block_mask = _block_mask_type()
    if block_mask is not None and isinstance(mask, block_mask):
        shape = tuple(mask.shape)
        if len(shape) == 4 and shape[2:] == (queries, keys) and shape[1] == 1 and shape[0] in (1, batch):
            return None
        return (f"{where}: a flex BlockMask of shape {shape} cannot be placed on the head shard; expected one "
                f"built for ({batch} or 1, 1, {queries}, {keys}): one head, the global query and key lengths")
    if not isinstance(mask, torch.Tensor):
        return f"{where}: the attention mask is a {type(mask).__name__}; expected a torch.Tensor or None"
    shape = tuple(mask.shape)
    if not 1 <= mask.dim() <= 4:
        return f"{where}: an attention mask of shape {shape} ({mask.dim()} dims); expected 1 to 4 dims"
    if shape[-1] != keys:
        local = " (this rank's own tokens: build it for the whole sequence)" if shape[-1] == local_keys else ""
        return (f"{where}: an attention mask of shape {shape} has {shape[-1]} keys{local}; expected "
                f"{_expected(batch, heads, queries, keys)}")
    allowed = [(1, queries, batch) if mask.dim() == 2 else (1, queries), (1, heads), (1, batch)]
    for k, options in enumerate(allowed[:mask.dim() - 1], start=2):
        if shape[-k] not in options:
            local = " (this rank's own tokens)" if k == 2 and shape[-k] == local_keys else ""
            return (f"{where}: an attention mask of shape {shape} has {shape[-k]} on dim {mask.dim() - k}{local}; "
                    f"expected {_expected(batch, heads, queries, keys)}")
    return None


def place_mask(mask: Any, heads: int, mine: tuple[int, int]) -> Any:
    """The checked ``mask`` for this rank's heads ``mine = (first, count)``: unchanged unless it has H heads."""
    if isinstance(mask, torch.Tensor) and mask.dim() >= 3 and mask.shape[-3] == heads and heads > 1:
        return mask.narrow(mask.dim() - 3, *mine)
    return mask
