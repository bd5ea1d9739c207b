"""Rank order, validation and the groups Topology.build creates."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dsp_plugin.topology import Topology, rank_layout, validate_sizes
from tests.distributed import run_distributed


def test_megatron_order_tp_innermost_then_dsp() -> None:
    layout = rank_layout(8, tp=2, dsp=2)           # dp = 2
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dsp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["dp_dsp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["model_parallel"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_pipeline_is_outermost() -> None:
    layout = rank_layout(8, dsp=2, pp=2)           # dp = 2
    assert layout["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["dsp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # every axis partitions the world
    for groups in layout.values():
        assert sorted(r for g in groups for r in g) == list(range(8))


@pytest.mark.parametrize(("world", "sizes", "message"), [
    (6, {"tp": 2, "dsp": 4}, r"world size 6 is not divisible by tp\(2\) \* dsp\(4\) \* pp\(1\) = 8"),
    (8, {"dsp": 3}, r"world size 8 is not divisible by tp\(1\) \* dsp\(3\) \* pp\(1\) = 3"),
    (4, {"dsp": 0}, r"dsp must be a positive int, got 0"),
    (4, {"tp": 2, "pp": -1}, r"pp must be a positive int, got -1"),
])
def test_invalid_factorization_names_every_factor(world: int, sizes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_sizes(world, **sizes)


def _build(rank: int, n: int) -> dict[str, object]:
    out: dict[str, object] = {}
    try:  # raised on every rank before any group is created
        Topology.build(dsp=3)
    except ValueError as exc:
        out["error"] = str(exc)
    topo = Topology.build(dsp=2)
    out["sizes"] = (topo.tp, topo.dsp, topo.dp, topo.pp)
    out["coords"] = topo.coords()
    out["dsp"] = dist.get_process_group_ranks(topo.dsp_group)
    out["dp"] = dist.get_process_group_ranks(topo.dp_group)
    out["dp_dsp"] = dist.get_process_group_ranks(topo.dp_dsp_group)
    out["describe"] = topo.describe()
    return out


def test_build_creates_the_layout_groups() -> None:
    results = run_distributed(_build, 4)
    for rank, res in enumerate(results):
        assert res["error"] == ("invalid parallel sizes: world size 4 is not divisible by "
                                "tp(1) * dsp(3) * pp(1) = 3")
        assert res["sizes"] == (1, 2, 2, 1)
        assert res["coords"] == {"tp": 0, "dsp": rank % 2, "dp": rank // 2, "pp": 0}
        assert res["dsp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert res["dp"] == [rank % 2, rank % 2 + 2]
        assert res["dp_dsp"] == [0, 1, 2, 3]
        assert res["describe"].startswith("tp(1) x dsp(2) x dp(2) x pp(1) = 4; rank")
