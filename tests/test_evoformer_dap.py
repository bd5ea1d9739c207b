"""examples/evoformer_dap.py: the Evoformer in DAP's layout equals one process (fp64), with DAP's traffic.

Uneven residues and MSA rows (R=13, S=6) on 2 and 4 ranks: outputs, every parameter gradient after
``reduce_gradients`` and the input gradients within 1e-12 of one process; each block's collectives, measured
by ``CommAccounting``, are DAP's (``dap_bytes``): six all-to-alls and six all-gathers forward, six all-to-alls
and six reduce-scatters backward, no all-reduce.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import evoformer_dap

from tests.distributed import run_distributed


def _compare(rank: int, n: int) -> dict[str, Any]:
    return evoformer_dap.compare(rank, n, ("partial",))


@pytest.mark.parametrize("world_size", [2, 4])
def test_evoformer_dap_matches_one_process(world_size: int) -> None:
    for report in run_distributed(_compare, world_size):
        result = report["modes"]["partial"]
        for key in ("output", "param_grad", "input_grad"):
            assert result[key] < 1e-12, (f"rank {report['rank']}: {key} differs from one process by "
                                         f"{result[key]:.3g}: {result}")
        traffic = result["traffic"]
        assert "all_reduce/backward" not in traffic, traffic
        assert traffic == report["dap"], (f"rank {report['rank']}: a block's collectives {traffic} are not DAP's "
                                          f"{report['dap']}")
