"""``python -m dsp_plugin.bench.wan``: the full-3D row runs and reports true counts (no timing is asserted)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")


@pytest.mark.slow
def test_wan_row_quick() -> None:
    from dsp_plugin.bench.wan import markdown, wan_row

    row = wan_row(2, quick=True, steps=1)
    assert row["max_diff"] < 1e-5, row
    assert row["all_to_all_per_layer"] == 2 and row["all_gather"] == 1, row
    table = markdown(row)
    assert "| dsp_plugin.parallelize (head switch) | 2 |" in table
    # diffusers' Ulysses reshapes heads into N equal groups: 3 heads on 2 ranks cannot run there
    assert "cannot run: 3 heads on 2 ranks" in table
