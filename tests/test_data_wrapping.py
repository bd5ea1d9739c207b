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
    with pytest.raises(ValueError, match="checkpoint was written with batch_size=2, this loader has batch_size=3"):
        dsp_dataloader(DATA, batch_size=3, dp_size=2, dp_rank=0).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="checkpoint was written with dp_size=2, this loader has dp_size=1"):
        dsp_dataloader(DATA, batch_size=2, dp_size=1, dp_rank=0).load_state_dict(loader.state_dict())
