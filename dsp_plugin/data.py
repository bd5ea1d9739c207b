"""``dsp_dataloader``: the same samples and the same random draws on every rank of a DSP group.

A DSP group cooperates on one batch: each rank holds a shard of the same
samples, so all its ranks must draw identical batches, shuffling and random
augmentation included, while data-parallel ranks draw different ones. Everything
here is a function of ``(seed, epoch, dp_rank, dp_size)`` and the batch's index
in the epoch, never of the global rank, the number of workers or the process's
RNG state, which gives both properties without communication:

* order: a permutation seeded by ``seed + epoch`` (as ``DistributedSampler``),
  strided over DP ranks;
* random draws: before fetching batch ``b`` the dataset's ``__getitem__`` runs
  with torch's CPU generator, ``numpy.random`` and ``random`` seeded from
  ``(seed, epoch, dp_rank, b)``, in a worker or, with ``num_workers=0``, in the
  main process, whose RNG states are restored afterwards (data loading does
  not move the model's random stream);
* worker processes: their base seed (``get_worker_info().seed``) comes from
  ``(seed, epoch, dp_rank)``.

So a resumed run replays the same draws, not only the same order.

Padding: without ``drop_last`` every DP rank still yields the same number of
batches (a DP all-reduce needs it), so the epoch's order is padded by repeating
its first ``ceil(len / dp) * dp - len`` samples, as ``DistributedSampler`` does:
DP ranks then share those few samples. With ``drop_last=True`` they are
disjoint and the last ``len % dp`` samples of the permutation are skipped.

The catalogue of behaviours and errors is in docs/data_and_accounting.md.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)

__all__ = ["DSPDataLoader", "DSPSampler", "dsp_dataloader", "stream_seed"]

#: DataLoader settings carried over when wrapping a loader (sampler, batching and generator are ours)
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
            "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
#: DataLoader arguments that would replace what this module controls
_REFUSED = ("sampler", "batch_sampler", "generator")


def stream_seed(*key: int) -> int:
    """A 64-bit seed from non-negative ints (``numpy.random.SeedSequence``): ``(seed, epoch, dp_rank[, batch])``."""
    low, high = np.random.SeedSequence(list(key)).generate_state(2, np.uint32)
    return int(low) | int(high) << 32


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, numpy's global RandomState and ``random``; restore them on exit."""
    saved = torch.random.default_generator.get_state(), np.random.get_state(), random.getstate()
    torch.random.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)
    random.seed(seed)
    try:
        yield
    finally:
        torch.random.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


class _SeededDataset(Dataset):
    """Fetches a batch of ``(batch_seed, index)`` keys with the RNGs seeded from the batch's seed."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        indices = [index for _, index in keys]
        with _seeded(keys[0][0]):
            getitems = getattr(self.dataset, "__getitems__", None)
            return list(getitems(indices)) if getitems else [self.dataset[i] for i in indices]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]


class DSPSampler(Sampler[int]):
    """Indices for one DP rank: a seeded permutation per epoch, strided over DP ranks.

    ``DistributedSampler``'s order with ``num_replicas=dp_size, rank=dp_rank``
    (padding included), able to start mid-epoch (``skip`` samples already consumed).
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


class _Batches(Sampler[list[tuple[int, int]]]):
    """This epoch's batches from ``first`` on, each key carrying its batch's seed."""

    def __init__(self, loader: DSPDataLoader, first: int) -> None:
        self.loader, self.first = loader, first

    def __len__(self) -> int:
        return max(len(self.loader) - self.first, 0)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s, size = self.loader.sampler, self.loader.batch_size
        s.skip = 0
        mine = list(s)
        for b in range(self.first, len(self.loader)):
            seed = stream_seed(s.seed, s.epoch, s.dp_rank, b)
            yield [(seed, i) for i in mine[b * size:(b + 1) * size]]


class DSPDataLoader:
    """A DataLoader over a ``DSPSampler`` that counts what it yielded, for resuming.

    Each full pass advances the epoch (a new permutation); ``set_epoch`` sets
    it explicitly, like ``DistributedSampler.set_epoch``. ``drop_last`` drops
    the last incomplete batch; ``sampler_drop_last`` (default: ``drop_last``)
    chooses between truncating and padding the order to a multiple of DP, as
    ``DistributedSampler(drop_last=...)`` does.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_size: int, dp_rank: int, seed: int,
                 shuffle: bool, drop_last: bool, sampler_drop_last: bool | None = None,
                 **loader_kwargs: Any) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = DSPSampler(len(dataset), dp_size=dp_size, dp_rank=dp_rank, seed=seed,  # type: ignore[arg-type]
                                  shuffle=shuffle, drop_last=drop_last if sampler_drop_last is None
                                  else sampler_drop_last)
        self.drop_last = drop_last
        self._loader_kwargs = loader_kwargs
        self._generator = torch.Generator()
        self.batches_yielded = 0  # in the current epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.epoch, self.sampler.skip, self.batches_yielded = epoch, 0, 0

    def worker_seed(self) -> int:
        """The workers' base seed this epoch: a function of ``(seed, epoch, dp_rank)`` only."""
        s = self.sampler
        return stream_seed(s.seed, s.epoch, s.dp_rank)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        self._generator.manual_seed(self.worker_seed())  # DataLoader draws the workers' base seed from it
        loader = DataLoader(_SeededDataset(self.dataset), batch_sampler=_Batches(self, self.batches_yielded),
                            generator=self._generator, **self._loader_kwargs)
        for batch in loader:
            self.batches_yielded += 1
            yield batch
        self.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, int]:
        """The epoch, the position in it and the settings that give the position its meaning.

        ``samples_consumed`` counts the whole DP group's samples (``batches_yielded *
        batch_size * dp_size``), so a run can resume with another DP size or micro-batch size
        as long as the global batch still divides it."""
        s = self.sampler
        return {"epoch": s.epoch, "batches_yielded": self.batches_yielded, "seed": s.seed,
                "dp_size": s.dp_size, "batch_size": self.batch_size, "length": s.length,
                "samples_consumed": self.batches_yielded * self.batch_size * s.dp_size,
                "shuffle": int(s.shuffle), "drop_last": int(self.drop_last), "sampler_drop_last": int(s.drop_last)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the next batch of the saved epoch (the same draws with the same DP layout).

        Settings that change the order must match; older checkpoints record only ``epoch``,
        ``batches_yielded`` and ``seed`` and are read as written by this layout."""
        mine = self.state_dict()
        for key in ("seed", "length", "shuffle", "drop_last", "sampler_drop_last"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"dsp_dataloader: checkpoint was written with {key}={state[key]}, "
                                 f"this loader has {key}={mine[key]}")
        batches = state["batches_yielded"]
        if "samples_consumed" in state:
            global_batch = self.batch_size * self.sampler.dp_size
            if state["samples_consumed"] % global_batch:
                raise ValueError(
                    f"dsp_dataloader: checkpoint was written after {state['samples_consumed']} samples of epoch "
                    f"{state['epoch']} (batch_size={state['batch_size']} x dp_size={state['dp_size']}), not a "
                    f"whole number of this loader's global batches of batch_size={self.batch_size} x "
                    f"dp_size={self.sampler.dp_size} = {global_batch}")
            batches = state["samples_consumed"] // global_batch
        self.sampler.epoch = state["epoch"]
        self.batches_yielded = batches


def _int(name: str, value: Any, low: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"dsp_dataloader: {name} must be an int, got {value!r}") from None
    if number < low:
        raise ValueError(f"dsp_dataloader: {name} must be >= {low}, got {number}")
    return number


def _from_loader(loader: DataLoader, given: dict[str, Any], loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What to keep of ``loader``: batch size, drop_last, its sampler's shuffle (and seed and
    drop_last for a ``DistributedSampler``), workers and collation. Refuses samplers whose
    semantics (a subset, weights, replacement) the DSP sampler cannot reproduce."""
    if loader.batch_size is None:
        raise ValueError("dsp_dataloader: the DataLoader has a custom batch_sampler (batch_size=None); "
                         "pass the Dataset and batch_size instead")
    sampler = loader.sampler
    keep: dict[str, Any] = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if type(sampler) is SequentialSampler:
        keep["shuffle"] = False
    elif type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise ValueError("dsp_dataloader: the DataLoader's RandomSampler draws with replacement or a custom "
                             "num_samples; the DSP sampler gives each sample once per epoch. Pass the Dataset "
                             "(a torch.utils.data.Subset for a subset) instead")
        keep["shuffle"] = True
    elif type(sampler) is DistributedSampler:
        # its num_replicas/rank are replaced by the DP axis: that is what makes a DSP group agree
        keep.update(shuffle=sampler.shuffle, seed=sampler.seed, sampler_drop_last=sampler.drop_last,
                    epoch=sampler.epoch)
    else:
        raise ValueError(f"dsp_dataloader: cannot keep the semantics of the DataLoader's "
                         f"{type(sampler).__name__} (only SequentialSampler, RandomSampler and "
                         f"DistributedSampler are understood); pass the Dataset instead")
    keep.update({k: v for k, v in given.items() if v is not None})
    for key in _CARRIED:
        loader_kwargs.setdefault(key, getattr(loader, key))
    if not loader_kwargs["num_workers"]:
        loader_kwargs.pop("prefetch_factor")  # DataLoader rejects it without workers
    return keep


def dsp_dataloader(data: Dataset | DataLoader, *, batch_size: int | None = None, seed: int | None = None,
                   shuffle: bool | None = None, drop_last: bool | None = None, dp_size: int | None = None,
                   dp_rank: int | None = None, **loader_kwargs: Any) -> DSPDataLoader:
    """Wrap a Dataset or a DataLoader so a DSP group sees identical batches and random draws.

    From a DataLoader it keeps the dataset, batch size, drop_last, collate_fn,
    workers and the other worker settings, and its sampler's semantics:
    ``SequentialSampler`` -> no shuffle, ``RandomSampler`` -> shuffle,
    ``DistributedSampler`` -> its shuffle, seed, drop_last and epoch (its
    ``num_replicas``/``rank`` become the DP axis); any other sampler is refused.
    Explicit arguments win. ``dp_size``/``dp_rank``: both or neither; neither
    takes the current topology's DP axis (1 and 0 without one). ``seed``
    defaults to 0.
    """
    for key in _REFUSED:
        if key in loader_kwargs:
            raise ValueError(f"dsp_dataloader: {key}= is not accepted: the DSP sampler chooses the order and "
                             f"the worker seeds from (seed, epoch, dp_rank)")
    given = {"batch_size": batch_size, "seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise ValueError("dsp_dataloader: the DataLoader is over an IterableDataset, whose order a sampler "
                             "cannot set; shard it yourself so every DSP rank reads the same stream")
        keep = _from_loader(data, given, loader_kwargs)
        dataset = data.dataset
    elif isinstance(data, IterableDataset):
        raise ValueError("dsp_dataloader: an IterableDataset has no indices to sample; shard it yourself so "
                         "every DSP rank reads the same stream")
    elif isinstance(data, Dataset):
        dataset, keep = data, {k: v for k, v in given.items() if v is not None}
        if not hasattr(data, "__len__"):
            raise TypeError(f"dsp_dataloader: the dataset {type(data).__name__} has no __len__")
    else:
        raise TypeError(f"dsp_dataloader: expected a Dataset or a DataLoader, got {type(data).__name__}")
    size = keep.get("batch_size")
    try:
        size = operator.index(size) if not isinstance(size, bool) else None
    except TypeError:
        size = None
    if size is None or size < 1:
        raise ValueError(f"dsp_dataloader: batch_size must be a positive int, got {keep.get('batch_size')!r}")
    keep["batch_size"] = size
    seed_value = _int("seed", keep.get("seed", 0), 0)
    if (dp_size is None) != (dp_rank is None):
        given_one = f"dp_size={dp_size}" if dp_rank is None else f"dp_rank={dp_rank}"
        raise ValueError(f"dsp_dataloader: pass both dp_size and dp_rank, or neither (then the topology's DP "
                         f"axis is used); got only {given_one}")
    if dp_size is None or dp_rank is None:
        from dsp_plugin.topology import get_topology

        topology = get_topology()
        dp_size, dp_rank = (topology.dp, topology.coords()["dp"]) if topology is not None else (1, 0)
    dp_size, dp_rank = _int("dp_size", dp_size, 1), _int("dp_rank", dp_rank, 0)
    loader = DSPDataLoader(dataset, batch_size=keep["batch_size"], dp_size=dp_size, dp_rank=dp_rank,
                           seed=seed_value, shuffle=bool(keep.get("shuffle", False)),
                           drop_last=bool(keep.get("drop_last", False)),
                           sampler_drop_last=keep.get("sampler_drop_last"), **loader_kwargs)
    if keep.get("epoch"):
        loader.set_epoch(keep["epoch"])
    return loader
