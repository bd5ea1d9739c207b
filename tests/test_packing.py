"""The local copies of a switch (dsp_plugin.packing): exact results, and how many copy kernels they cost.

Counted with a TorchDispatchMode, so every aten copy/clone/contiguous that
reaches a kernel is seen, whoever issued it.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsp_plugin.packing import chunk_sizes, join_blocks, split_blocks

_COPIES = {"copy_", "clone", "_to_copy", "cat", "contiguous", "index_select", "as_strided_copy"}


class _CountCopies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in _COPIES:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def _blocks(x: torch.Tensor, dim: int, n: int) -> list[torch.Tensor]:
    return list(x.tensor_split(n, dim=dim))


@pytest.mark.parametrize("shape,dim,n", [((2, 8, 6, 3), 1, 4), ((2, 7, 6, 3), 1, 4), ((2, 8, 6, 3), 2, 3),
                                         ((1, 8, 6, 3), 1, 2), ((3, 5), 0, 2)])
def test_split_blocks_lays_the_chunks_out_in_order(shape: tuple[int, ...], dim: int, n: int) -> None:
    x = torch.randn(shape)
    buffer, sizes = split_blocks(x, dim, n)
    expected = torch.cat([b.reshape(-1) for b in _blocks(x, dim, n)])
    assert torch.equal(buffer, expected)
    per_block = [b.numel() for b in _blocks(x, dim, n)]
    assert sizes == (None if len(set(per_block)) == 1 else per_block)


@pytest.mark.parametrize("shape,dim,n", [((2, 8, 6, 3), 1, 4), ((2, 8, 7, 3), 2, 4), ((1, 8, 6, 3), 1, 2)])
@pytest.mark.parametrize("fold_for", [None, 1, 2])
def test_join_blocks_concatenates(shape: tuple[int, ...], dim: int, n: int, fold_for: int | None) -> None:
    x = torch.randn(shape)
    blocks = _blocks(x, dim, n)
    buffer = torch.cat([b.reshape(-1) for b in blocks])
    block_shape = list(shape)
    block_shape[dim] = 0
    out = join_blocks(buffer, [*shape[:dim], blocks[0].shape[dim], *shape[dim + 1:]], dim,
                      chunk_sizes(shape[dim], n), fold_for=fold_for)
    assert torch.equal(out, x)
    if fold_for is not None:
        # the memory order a block folding every other dim into the batch wants: a free view
        assert out.movedim(fold_for, -2).is_contiguous()


def test_one_copy_each_way_when_sizes_divide() -> None:
    x = torch.randn(2, 8, 6, 3)
    with _CountCopies() as mode:
        buffer, _ = split_blocks(x, 2, 3)
    assert mode.copies == 1
    with _CountCopies() as mode:
        join_blocks(buffer, [2, 2, 6, 3], 1, [2, 2, 2, 2])  # any four blocks of 2 x 2 x 6 x 3
    assert mode.copies == 1


def test_no_copy_when_the_layout_already_matches() -> None:
    x = torch.randn(1, 8, 6, 3)       # leading dims of size 1: the T-chunks lie in memory in order
    with _CountCopies() as mode:
        buffer, _ = split_blocks(x, 1, 4)
        out = join_blocks(buffer, [1, 2, 6, 3], 1, [2, 2, 2, 2])
    assert mode.copies == 0
    assert torch.equal(out, x)


def test_uneven_sizes_copy_once_per_block() -> None:
    x = torch.randn(2, 7, 6, 3)
    with _CountCopies() as mode:
        split_blocks(x, 1, 4)
    assert mode.copies == 4
