"""dsp_dataloader's random streams: a function of (seed, epoch, dp_rank, batch), nothing else.

A DSP peer is another loader with the same DP coordinate in a process whose global RNGs
are in another state; a DP peer has another ``dp_rank``. The multi-process version is in
test_data.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from dsp_plugin import dsp_dataloader


class Draws(Dataset):
    """Sample i: [i, a torch draw, a numpy draw, a random draw, the worker's seed (-1 in the main process)]."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random(),
                             float(info.seed % 2**24) if info else -1.0], dtype=torch.float64)


def _run(process_seed: int, dp_rank: int, *, workers: int = 0, epochs: int = 1, **kw: object) -> list[list]:
    torch.manual_seed(process_seed)
    np.random.seed(process_seed)
    random.seed(process_seed)
    loader = dsp_dataloader(Draws(), batch_size=3, seed=5, shuffle=True, dp_size=2, dp_rank=dp_rank,
                            num_workers=workers, **kw)
    return [batch.tolist() for _ in range(epochs) for batch in loader]


def _column(batches: list[list], k: int) -> list[float]:
    return [sample[k] for batch in batches for sample in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_dsp_peers_draw_alike_whatever_their_process_rng(workers: int) -> None:
    mine = _run(1, 0, workers=workers, epochs=2)
    assert _run(2, 0, workers=workers, epochs=2) == mine           # a DSP peer: same batches, same draws
    dp_peer = _run(1, 1, workers=workers, epochs=2)
    for k in (1, 2, 3):                                              # torch, numpy, random
        assert _column(dp_peer, k) != _column(mine, k)


def test_draws_do_not_depend_on_the_number_of_workers() -> None:
    strip = lambda batches: [[s[:4] for s in b] for b in batches]   # noqa: E731 - drop the worker seed
    assert strip(_run(0, 1, workers=0)) == strip(_run(0, 1, workers=2))


def test_worker_seeds_follow_seed_epoch_and_dp_rank() -> None:
    def seeds(process_seed: int, dp_rank: int) -> list[set[float]]:
        batches = _run(process_seed, dp_rank, workers=1, epochs=2)
        per_epoch = len(batches) // 2
        return [set(_column(batches[:per_epoch], 4)), set(_column(batches[per_epoch:], 4))]

    mine = seeds(1, 0)
    assert seeds(2, 0) == mine                                       # DSP peer: the same worker seeds
    assert mine[0] != mine[1]                                        # a new epoch, a new seed
    other = seeds(1, 1)
    assert other[0].isdisjoint(mine[0]) and other[1].isdisjoint(mine[1])  # DP peers differ


def test_the_process_rng_is_left_where_it_was() -> None:
    """Loading seeds torch's, numpy's and ``random``'s global generators per batch and restores all three."""
    def seed_all() -> None:
        torch.manual_seed(3)
        np.random.seed(3)
        random.seed(3)

    def draws() -> dict[str, list[float]]:
        return {"torch": torch.rand(4).tolist(), "numpy": np.random.rand(4).tolist(),
                "random": [random.random() for _ in range(4)]}

    seed_all()
    expected = draws()
    seed_all()
    list(dsp_dataloader(Draws(), batch_size=3, dp_size=1, dp_rank=0))
    got = draws()
    for name in expected:
        assert got[name] == expected[name], f"loading a batch did not restore the process's {name} RNG state"


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_replays_the_same_draws(workers: int) -> None:
    full = _run(0, 1, workers=workers, epochs=2)
    torch.manual_seed(0)
    loader = dsp_dataloader(Draws(), batch_size=3, seed=5, shuffle=True, dp_size=2, dp_rank=1, num_workers=workers)
    first_epoch = [b.tolist() for b in loader]
    it = iter(loader)
    seen = first_epoch + [next(it).tolist()]
    state = loader.state_dict()
    torch.manual_seed(123)                                           # a restarted process
    resumed = dsp_dataloader(Draws(), batch_size=3, seed=5, shuffle=True, dp_size=2, dp_rank=1,
                             num_workers=workers)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    strip = lambda batches: [[s[:4] for s in b] for b in batches]   # noqa: E731 - drop the worker seed
    assert strip(seen + rest) == strip(full)
