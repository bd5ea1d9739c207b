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

Under ``sharded_io`` (a sampling loop feeds the model its frame shard) a model that
builds its mask from what it is fed (HunyuanVideo: ``latent_sequence_length =
hidden_states.shape[1]``) builds it from ``R + L_local`` keys. The runtime knows the
global lengths there, so one such mask can be laid out exactly:

==============================================  ====================================================
``[B | 1, H | 1, 1, R + L_local]`` (or ``[Lk]``)   under ``sharded_io`` only: a key-padding mask (query
                                                dim 1) built from this rank's tokens. Its video key
                                                columns are gathered over the group (one all_gather,
                                                uneven shards padded inside), its ``R`` joint columns
                                                kept in place (``joint="last"``: video then text;
                                                ``"first"``: text then video): ``[.., 1, R + L]``.
                                                Once per forward per mask object (the same mask reaches
                                                every block: cached by identity in the forward's frame)
==============================================  ====================================================

Under ``sharded_io`` every key-padding mask (query dim 1) goes through that
gather, so every rank issues it whatever its shape says (a rank holding the
whole sequence cannot tell a local mask from a global one): a global one
contributes this rank's own columns of it, which gives it back unchanged. A
local mask with a query dim > 1 cannot be placed (its rows are this rank's
queries, and the switched attention holds every query) and is refused on
every rank, naming its shape; so is a local mask outside ``sharded_io``.

One local mask with query rows is laid out, under ``sharded_io`` or not: a bool
padding mask of query-key pairs ``[B | 1, 1, S, S]``, ``mask[i, j] = p[i] & p[j]``
over this rank's ``S = R + L_local`` tokens, which HunyuanVideo 1.5's processor
builds from its text mask and the tokens it is called with. Its diagonal ``p`` is
the tokens' padding: the video entries are gathered (one all_gather per attention
call: the processor builds a new mask each call) and the pairs rebuilt for
``R + L`` tokens (``gather_pairs``). Each rank checks that its mask is such a
product; one of that shape that is not is refused on every rank after the gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_mask", "gather_key_padding", "gather_pairs", "is_key_padding", "is_local_pairs", "place_mask"]


def _block_mask_type() -> type | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch < 2.5
        return None
    return BlockMask


def _expected(batch: int, heads: int, queries: int, keys: int) -> str:
    return (f"a mask for the global sequence: last dim {keys} keys, then from the right {queries} queries or 1, "
            f"{heads} heads or 1, {batch} samples or 1")


def is_key_padding(mask: Any) -> bool:
    """A tensor mask with no query dim, or a query dim of 1 (``[Lk]``, ``[1, Lk]``, ``[B|1, H|1, 1, Lk]``)."""
    return isinstance(mask, torch.Tensor) and 1 <= mask.dim() <= 4 and (mask.dim() == 1 or mask.shape[-2] == 1)


def check_mask(where: str, mask: Any, *, batch: int, heads: int, queries: int, keys: int,
               local_keys: int, sharded_io: bool = False) -> str | None:
    """Why ``mask`` cannot be placed for the switched attention (None: it can); no collective, no copy.
    ``sharded_io``: the model is fed its shard, so a key-padding mask of ``local_keys`` keys is placed too
    (``gather_key_padding``)."""
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
    if sharded_io and shape[-1] == local_keys != keys:
        if not is_key_padding(mask):
            return (f"{where}: under sharded_io an attention mask of shape {shape} built from this rank's "
                    f"{local_keys} tokens has {shape[-2]} queries; only a key-padding mask (query dim 1, e.g. "
                    f"[{batch}, 1, 1, {local_keys}]) can be laid out for the switched attention (its key columns "
                    f"gathered); expected that, or {_expected(batch, heads, queries, keys)}")
        keys, queries = local_keys, 1  # the batch and head dims are checked as for a global mask
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


def gather_key_padding(mask: torch.Tensor, *, lengths: list[tuple[int, int]], axis: int, count: int,
                       joint: str | None, group: Any) -> torch.Tensor:
    """Under ``sharded_io``: a checked key-padding mask (``is_key_padding``) for the global sequence.

    ``lengths``: the (local, global) lengths of the axes folded into the video tokens, ``axis`` the sharded
    one, ``count`` the ``R`` joint tokens (``joint``: where they sit). The mask holds ``R + L_local`` keys (built
    from this rank's tokens) or ``R + L`` (built for the whole sequence: this rank's columns of it are sent).
    One all_gather of the video key columns (a bool mask travels as uint8); the joint columns stay in place.
    """
    from dsp_plugin.comm import chunk_sizes, gather, group_rank, group_size
    from dsp_plugin.packing import offsets

    local, full = [a for a, _ in lengths], [b for _, b in lengths]
    mine, total, last = math.prod(local), math.prod(full), mask.dim() - 1
    first = joint == "first"
    video_at = count if first else 0
    text = mask.narrow(last, 0 if first else mask.shape[last] - count, count)
    if mask.shape[last] == count + mine:  # built from this rank's tokens
        video = mask.narrow(last, video_at, mine).unflatten(last, local)
    else:                                 # built for the whole sequence: this rank's own columns
        n, rank = group_size(group), group_rank(group)
        start = offsets(chunk_sizes(full[axis], n))[rank]
        video = mask.narrow(last, video_at, total).unflatten(last, full).narrow(last + axis, start, local[axis])
    wire = video.to(torch.uint8) if video.dtype == torch.bool else video
    whole = gather(wire.contiguous(), last + axis, group=group, global_len=full[axis]).to(mask.dtype)
    whole = whole.flatten(last, last + len(full) - 1)
    return torch.cat((text, whole) if first else (whole, text), dim=last)


def place_mask(mask: Any, heads: int, mine: tuple[int, int]) -> Any:
    """The checked ``mask`` for this rank's heads ``mine = (first, count)``: unchanged unless it has H heads."""
    if isinstance(mask, torch.Tensor) and mask.dim() >= 3 and mask.shape[-3] == heads and heads > 1:
        return mask.narrow(mask.dim() - 3, *mine)
    return mask


def is_local_pairs(mask: Any, *, local: int, total: int) -> bool:
    """By shape alone (the same decision on every rank): a square bool mask ``[B | 1, 1, S, S]`` built for this
    rank's ``S = R + L_local`` tokens where the sequence holds ``R + L`` (``local != total``): a candidate for
    ``gather_pairs`` (HunyuanVideo 1.5's processor pads its text mask to the tokens it is called with)."""
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and local != total
            and mask.shape[1] == 1 and mask.shape[-2] == mask.shape[-1] == local)


def gather_pairs(where: str, mask: torch.Tensor, *, lengths: list[tuple[int, int]], axis: int, count: int,
                 joint: str | None, group: Any) -> torch.Tensor:
    """A padding mask of query-key pairs ``p ⊗ p`` (``[B, 1, S, S]``, ``p`` the tokens' padding over this rank's
    ``S = R + L_local`` tokens), laid out for the global sequence: ``p``'s video entries gathered (one all_gather,
    its ``R`` joint entries kept in place, as ``gather_key_padding``), the global pairs rebuilt ``[B, 1, R+L, R+L]``.

    Every rank checks that its mask is such an outer product (a bool mask and its diagonal ``p``: ``mask == p_i &
    p_j``); one that is not sends a marker inside the same gather, and every rank then refuses it, naming its
    shape: a mask of another kind built from a shard cannot be placed."""
    from dsp_plugin.comm import gather

    local, full = [a for a, _ in lengths], [b for _, b in lengths]
    mine, last = math.prod(local), 3
    pad = mask.diagonal(dim1=-2, dim2=-1)                       # [B, 1, S]: the tokens' padding
    ok = bool(torch.equal(mask, pad.unsqueeze(-1) & pad.unsqueeze(-2)))
    first = joint == "first"
    keys = pad.unsqueeze(-2)                                    # [B, 1, 1, S]
    text = keys.narrow(last, 0 if first else mine, count)
    video = keys.narrow(last, count if first else 0, mine).to(torch.uint8)
    if not ok:
        video = torch.full_like(video, 2)                       # the marker: every rank refuses after the gather
    whole = gather(video.unflatten(last, local).contiguous(), last + axis, group=group, global_len=full[axis])
    if bool((whole == 2).any()):
        raise ValueError(f"{where}: an attention mask of shape {tuple(mask.shape)} built from a rank's {mine + count} "
                         f"tokens is not a padding mask of query-key pairs (mask[i, j] == p[i] & p[j]) on every rank, "
                         f"so it cannot be laid out for the global sequence; expected that, or a mask built for the "
                         f"global sequence ({count + math.prod(full)} keys)")
    whole = whole.flatten(last, last + len(full) - 1).bool()
    keys = torch.cat((text, whole) if first else (whole, text), dim=last)  # [B, 1, 1, R + L]
    return keys.transpose(-1, -2) & keys
