"""``dsp_dataloader``: the same samples on every rank of a DSP group, different ones across DP.

A DSP group cooperates on one batch: each rank holds a shard of the same
samples, so all its ranks must draw identical batches, shuffling included,
while data-parallel ranks draw disjoint ones. The sampler here depends only on
``(seed, epoch, dp_rank, dp_size)``, never on the global rank, which gives both
properties without communication. Worker processes are seeded from the same
values, so random augmentation in ``__getitem__`` agrees across a DSP group too.

Resuming: ``state_dict()`` records the epoch and the batches already yielded in
it; ``load_state_dict`` continues from the next batch of the same permutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["DSPDataLoader", "DSPSampler", "dsp_dataloader"]


class DSPSampler(Sampler[int]):
    """Indices for one DP rank: a seeded permutation per epoch, strided over DP ranks.

    Like ``DistributedSampler`` but keyed by the DP coordinate, and able to
    start mid-epoch (``skip`` samples already consumed).
    """

    def __init__(self, length: int, *, dp_size: int, dp_rank: int, seed: int, shuffle: bool,
                 drop_last: bool) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dsp_dataloader: dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if length < dp_size and drop_last:
            raise ValueError(f"dsp_dataloader: dataset of {length} samples is smaller than the "
                             f"data-parallel size {dp_size} with drop_last=True: every rank would get nothing")
        self.length, self.dp_size, self.dp_rank = length, dp_size, dp_rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.skip = 0

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.dp_size
        return -(-self.length // self.dp_size)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        per_rank = len(self)
        total = per_rank * self.dp_size
        order = order[:total] if self.drop_last else (order * (total // max(len(order), 1) + 1))[:total]
        mine = order[self.dp_rank:total:self.dp_size]
        return iter(mine[self.skip:])


class DSPDataLoader:
    """A DataLoader over a ``DSPSampler`` that counts what it yielded, for resuming.

    Each full pass advances the epoch (a new permutation); ``set_epoch`` sets
    it explicitly, like ``DistributedSampler.set_epoch``.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_size: int, dp_rank: int, seed: int,
                 shuffle: bool, drop_last: bool, **loader_kwargs: Any) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = DSPSampler(len(dataset), dp_size=dp_size, dp_rank=dp_rank, seed=seed,  # type: ignore[arg-type]
                                  shuffle=shuffle, drop_last=drop_last)
        self.drop_last = drop_last
        self._loader_kwargs = loader_kwargs
        self._generator = torch.Generator()
        self.batches_yielded = 0  # in the current epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.epoch, self.sampler.skip, self.batches_yielded = epoch, 0, 0

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.skip = self.batches_yielded * self.batch_size
        # Workers' base seed comes from this generator: same on every DSP rank.
        self._generator.manual_seed(self.sampler.seed * 1_000_003 + self.sampler.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            generator=self._generator, drop_last=self.drop_last, **self._loader_kwargs)
        for batch in loader:
            self.batches_yielded += 1
            yield batch
        self.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches_yielded": self.batches_yielded, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.sampler.seed:
            raise ValueError(f"dsp_dataloader: checkpoint was written with seed={state['seed']}, "
                             f"this loader has seed={self.sampler.seed}")
        self.sampler.epoch = state["epoch"]
        self.batches_yielded = state["batches_yielded"]


def dsp_dataloader(data: Dataset | DataLoader, *, batch_size: int | None = None, seed: int = 0,
                   shuffle: bool | None = None, drop_last: bool | None = None, dp_size: int | None = None,
                   dp_rank: int | None = None, **loader_kwargs: Any) -> DSPDataLoader:
    """Wrap a Dataset or a DataLoader so a DSP group sees identical batches.

    From a DataLoader it keeps the dataset, batch size, collate_fn, workers,
    pin_memory and drop_last, and replaces the sampler (``shuffle`` defaults to
    whether the loader had a RandomSampler). ``dp_size``/``dp_rank`` default to
    the current topology's DP axis (1 and 0 without one or without
    torch.distributed).
    """
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise ValueError("dsp_dataloader: the DataLoader has a custom batch_sampler (batch_size=None); "
                             "pass the Dataset and batch_size instead")
        dataset = data.dataset
        batch_size = data.batch_size if batch_size is None else batch_size
        if shuffle is None:
            shuffle = isinstance(data.sampler, torch.utils.data.RandomSampler)
        drop_last = data.drop_last if drop_last is None else drop_last
        for key in ("collate_fn", "num_workers", "pin_memory", "persistent_workers", "worker_init_fn"):
            loader_kwargs.setdefault(key, getattr(data, key))
    elif isinstance(data, Dataset):
        dataset = data
    else:
        raise TypeError(f"dsp_dataloader: expected a Dataset or a DataLoader, got {type(data).__name__}")
    if batch_size is None or batch_size < 1:
        raise ValueError(f"dsp_dataloader: batch_size must be a positive int, got {batch_size!r}")
    if dp_size is None or dp_rank is None:
        from dsp_plugin.topology import get_topology

        topology = get_topology()
        if topology is not None:
            coords = topology.coords()
            dp_size, dp_rank = topology.dp, coords["dp"]
        else:
            dp_size, dp_rank = 1, 0
    return DSPDataLoader(dataset, batch_size=batch_size, dp_size=dp_size, dp_rank=dp_rank, seed=seed,
                         shuffle=bool(shuffle), drop_last=bool(drop_last), **loader_kwargs)
