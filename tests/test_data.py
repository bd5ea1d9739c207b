"""dsp_dataloader: identical batches inside a DSP group, disjoint across DP, seeded, resumable."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dsp_plugin import Topology, dsp_dataloader, set_topology
from tests.distributed import run_distributed


class Indexed(Dataset):
    """Sample i is a tensor holding i, plus a random draw that must agree inside a DSP group."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()])


def _indices(loader) -> list[list[int]]:  # noqa: ANN001
    return [batch[:, 0].long().tolist() for batch in loader]


def test_same_seed_same_order_and_a_new_permutation_each_epoch() -> None:
    a = dsp_dataloader(Indexed(), batch_size=4, seed=3, shuffle=True)
    b = dsp_dataloader(DataLoader(Indexed(), batch_size=4, shuffle=True), seed=3)
    first = _indices(a)
    assert first == _indices(b)
    assert sorted(i for batch in first for i in batch) == list(range(22))
    assert _indices(a) != first                       # epoch 1 is another permutation
    assert dsp_dataloader(Indexed(), batch_size=4, seed=4, shuffle=True).__iter__().__next__()[:, 0].tolist() \
        != [float(i) for i in first[0]]


def test_resume_mid_epoch_continues_the_same_permutation() -> None:
    full = _indices(dsp_dataloader(Indexed(), batch_size=3, seed=1, shuffle=True))
    loader = dsp_dataloader(Indexed(), batch_size=3, seed=1, shuffle=True)
    it = iter(loader)
    seen = [next(it)[:, 0].long().tolist() for _ in range(3)]
    state = loader.state_dict()
    resumed = dsp_dataloader(Indexed(), batch_size=3, seed=1, shuffle=True)
    resumed.load_state_dict(state)
    assert seen + _indices(resumed) == full
    with pytest.raises(ValueError, match="checkpoint was written with seed=1, this loader has seed=2"):
        dsp_dataloader(Indexed(), batch_size=3, seed=2).load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        dsp_dataloader(Indexed(), batch_size=0)
    with pytest.raises(TypeError, match="expected a Dataset or a DataLoader, got list"):
        dsp_dataloader([1, 2, 3], batch_size=1)  # type: ignore[arg-type]


def _per_rank_batches(rank: int, n: int) -> dict[int, list[list[list[float]]]]:
    set_topology(Topology.build(dsp=2))           # 4 ranks: dsp 2 x dp 2
    torch.manual_seed(100 + rank)                 # every process's own RNG state differs
    out = {}
    for workers in (0, 1):
        loader = dsp_dataloader(DataLoader(Indexed(), batch_size=2, shuffle=True, num_workers=workers), seed=7)
        out[workers] = [batch.tolist() for batch in loader]
    set_topology(None)
    return out


def test_dsp_group_identical_dp_disjoint_and_differently_drawn() -> None:
    per_rank = run_distributed(_per_rank_batches, 4)
    for workers in (0, 1):
        batches = [r[workers] for r in per_rank]
        # ranks 0,1 form a DSP group (dp 0), ranks 2,3 another (dp 1): same samples, same random draws
        assert batches[0] == batches[1] and batches[2] == batches[3], workers
        ids = [{int(s[0]) for b in batches[r] for s in b} for r in (0, 2)]
        assert ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == set(range(22))   # 22 = 2 x 11: no padding
        draws = [[s[1] for b in batches[r] for s in b] for r in (0, 2)]
        assert set(draws[0]).isdisjoint(draws[1]), workers                    # DP replicas draw differently
    # and the draws do not depend on the number of workers
    assert per_rank[0][0] == per_rank[0][1]
