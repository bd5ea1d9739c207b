"""Wrapping a DataLoader keeps its sampler's semantics or refuses; no argument is silently dropped.

The oracle for a ``DistributedSampler`` loader is torch's own sampler with
``num_replicas=dp_size, rank=dp_rank``: the wrapped loader must yield its batches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset,
                              WeightedRandomSampler)

from dsp_plugin import dsp_dataloader

DATA = TensorDataset(torch.arange(11))


def _ids(loader: object) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]  # type: ignore[attr-defined]


def test_a_distributed_sampler_loader_keeps_its_order_padding_and_epoch() -> None:
    for shuffle, sampler_drop, loader_drop in itertools.product([True, False], repeat=3):
        def torch_loader(num_replicas: int, rank: int) -> DataLoader:
            sampler = DistributedSampler(DATA, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=9,
                                         drop_last=sampler_drop)
            sampler.set_epoch(2)
            return DataLoader(DATA, batch_size=2, sampler=sampler, drop_last=loader_drop)

        for dp_rank in (0, 1):
            # the user's loader was built for a world of 4; DSP 2 x DP 2 makes it the DP axis
            wrapped = dsp_dataloader(torch_loader(4, 3), dp_size=2, dp_rank=dp_rank)
            assert _ids(wrapped) == _ids(torch_loader(2, dp_rank)), (shuffle, sampler_drop, loader_drop, dp_rank)


def test_samplers_it_cannot_reproduce_are_refused() -> None:
    weighted = DataLoader(DATA, batch_size=2, sampler=WeightedRandomSampler([1.0] * 11, 11))
    with pytest.raises(ValueError, match="cannot keep the semantics of the DataLoader's WeightedRandomSampler"):
        dsp_dataloader(weighted, dp_size=1, dp_rank=0)
    replacement = DataLoader(DATA, batch_size=2, sampler=RandomSampler(DATA, replacement=True))
    with pytest.raises(ValueError, match="RandomSampler draws with replacement or a custom num_samples"):
        dsp_dataloader(replacement, dp_size=1, dp_rank=0)


class Stream(IterableDataset):
    def __iter__(self):  # noqa: ANN204
        return iter(range(3))


def test_no_silent_overrides() -> None:
    with pytest.raises(ValueError, match="pass both dp_size and dp_rank, or neither .* got only dp_rank=1"):
        dsp_dataloader(DATA, batch_size=2, dp_rank=1)
    with pytest.raises(ValueError, match="got only dp_size=2"):
        dsp_dataloader(DATA, batch_size=2, dp_size=2)
    with pytest.raises(ValueError, match="sampler= is not accepted"):
        dsp_dataloader(DATA, batch_size=2, sampler=range(11), dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="generator= is not accepted"):
        dsp_dataloader(DATA, batch_size=2, generator=torch.Generator(), dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="an IterableDataset has no indices"):
        dsp_dataloader(Stream(), batch_size=2, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        dsp_dataloader(DATA, batch_size=2, seed=-1, dp_size=1, dp_rank=0)
    loader = dsp_dataloader(DATA, batch_size=2, dp_size=2, dp_rank=0)
    next(iter(loader))                                     # 2 x 2 = 4 samples of the epoch consumed
    with pytest.raises(ValueError, match="after 4 samples of epoch 0 .* not a whole number of this loader's "
                                         "global batches of batch_size=3 x dp_size=2 = 6"):
        dsp_dataloader(DATA, batch_size=3, dp_size=2, dp_rank=0).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="checkpoint was written with seed=0, this loader has seed=1"):
        dsp_dataloader(DATA, batch_size=2, seed=1, dp_size=2, dp_rank=0).load_state_dict(loader.state_dict())


def test_resume_with_another_dp_size_continues_the_permutation() -> None:
    """DSP 2 x DP 2 -> DSP 4 x DP 1 with the same global batch: the rest of the epoch, nothing twice."""
    data = TensorDataset(torch.arange(12))
    first = []
    state = None
    for dp_rank in (0, 1):
        loader = dsp_dataloader(data, batch_size=2, shuffle=True, dp_size=2, dp_rank=dp_rank)
        it = iter(loader)
        first += [i for _ in range(2) for i in next(it)[0].tolist()]
        state = loader.state_dict()
    resumed = dsp_dataloader(data, batch_size=4, shuffle=True, dp_size=1, dp_rank=0)
    resumed.load_state_dict(state)
    rest = [i for batch in _ids(resumed) for i in batch]
    whole = [i for batch in _ids(dsp_dataloader(data, batch_size=4, shuffle=True, dp_size=1, dp_rank=0))
             for i in batch]
    assert sorted(first) == sorted(whole[:8]) and rest == whole[8:]
