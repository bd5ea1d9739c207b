"""The local copies around a collective: cutting a tensor into per-rank blocks and joining blocks.

No communication here (``dsp_plugin.comm`` sends the buffers). The aim is the
fewest copies: when a dim divides by the group size, packing is ONE copy
(a ``movedim`` + ``contiguous``) and unpacking ONE strided copy; when the blocks
already lie in memory in order (every dim before the cut has size 1, e.g.
``[1, T, S, D]`` cut on T) there is no copy at all. Uneven dims fall back to
one copy per block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["chunk_sizes", "join_blocks", "offsets", "split_blocks"]


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(length), parts)``: the first ``length % parts`` get one more."""
    base = length // parts
    extra = length - base * parts  # not divmod: dynamo does not trace it on a symbolic length (dynamic=True)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def split_blocks(x: torch.Tensor, dim: int, n: int) -> tuple[torch.Tensor, list[int] | None]:
    """``x`` cut into its ``n`` tensor_split chunks along ``dim``, laid out one after another in a flat buffer.

    Returns ``(buffer, split sizes in elements)``; the sizes are ``None`` when all blocks are equal.
    The buffer may be ``x`` itself (viewed flat) when the blocks already lie in order.
    """
    length = x.shape[dim]
    if length % n == 0:
        # [.., L, ..] -> [.., n, L/n, ..] -> [n, .., L/n, ..]: one copy, none when already in order
        return x.unflatten(dim, (n, length // n)).movedim(dim, 0).contiguous().view(-1), None
    sizes = chunk_sizes(length, n)
    per_row = math.prod(x.shape) // length if length else 0
    buffer = x.new_empty(x.numel())
    for start, size in zip(offsets(sizes), sizes):
        block_shape = list(x.shape)
        block_shape[dim] = size
        buffer[start * per_row:(start + size) * per_row].view(block_shape).copy_(x.narrow(dim, start, size))
    return buffer, [per_row * s for s in sizes]


def join_blocks(buffer: torch.Tensor, block_shape: Sequence[int], dim: int, sizes: Sequence[int], *,
                fold_for: int | None = None) -> torch.Tensor:
    """Blocks ``i = 0..n-1`` of shape ``block_shape`` (with ``sizes[i]`` along ``dim``) concatenated along ``dim``.

    ``fold_for=a`` lays the result out in memory as ``out.movedim(a, -2).contiguous()``
    would be (the logical shape is unchanged), so a block that attends along dim
    ``a`` and folds every other dim into the batch gets that fold as a view.
    """
    n = len(sizes)
    out_shape = list(block_shape)
    out_shape[dim] = sum(sizes)
    if fold_for is None and math.prod(out_shape[:dim]) == 1:
        return buffer.view(out_shape)           # the blocks are already the output, in order
    if fold_for is None:
        out = buffer.new_empty(out_shape)
    else:
        memory_shape = list(out_shape)
        memory_shape.append(memory_shape.pop(fold_for))
        memory_shape[-1], memory_shape[-2] = memory_shape[-2], memory_shape[-1]
        out = buffer.new_empty(memory_shape).movedim(-2, fold_for)
    if len(set(sizes)) == 1:
        size = sizes[0]
        one = list(block_shape)
        one[dim] = size
        # [n, .., c, ..] -> [.., n, c, ..] written into the output in one strided copy
        out.unflatten(dim, (n, size)).copy_(buffer.view(n, *one).movedim(0, dim))
        return out
    per_row = math.prod(out_shape) // out_shape[dim] if out_shape[dim] else 0
    for start, size in zip(offsets(sizes), sizes):
        one = list(block_shape)
        one[dim] = size
        out.narrow(dim, start, size).copy_(buffer[start * per_row:(start + size) * per_row].view(one))
    return out
