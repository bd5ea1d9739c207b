"""The full-3D row (``python -m dsp_plugin.bench.wan``, a section of ``python -m dsp_plugin.bench``).

Our plan and diffusers' own Ulysses run side by side on 2 gloo ranks; both equal
the one-process model and issue the counts their code implies (2 all-to-alls per
layer against 4, the same bytes). No time is asserted: timing is the bench's output.
"""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")


@pytest.mark.slow
def test_wan_row_quick_runs_diffusers_beside_ours() -> None:
    from dsp_plugin.bench.wan import markdown, wan_row

    row = wan_row(2, quick=True, steps=1)
    ours, theirs = row["ours"], row["diffusers"]
    assert row["refused"] is None and row["diffusers_how"], row
    for r in (ours, theirs):
        assert r["max_diff"] < 1e-5, row
        assert r["all_gather"] == 1 and r["other"] == 0, row           # the exit gather, nothing else
    assert ours["all_to_all_per_layer"] == 2, ours                     # q, k, v packed + the output
    assert theirs["all_to_all_per_layer"] == 4, theirs                 # q, k, v apart + the output
    assert ours["a2a_bytes"] == theirs["a2a_bytes"] > 0                 # whole frames = the flat chunk here
    assert ours["gather_bytes"] == theirs["gather_bytes"]
    assert len(ours["rounds_s"]) == len(theirs["rounds_s"]) == 1 and "ratio" in row
    table = markdown(row)
    assert "| dsp_plugin.parallelize (head switch: q, k, v packed) | 2 |" in table
    assert "Ulysses (ulysses_degree=2; q, k, v apart) | 4 |" in table
    assert "Time ours / diffusers, same round" in table


def test_shapes_diffusers_ulysses_cannot_run_are_named() -> None:
    from dsp_plugin.bench.diffusers_cp import refusal

    assert refusal(3, 64, 2) == "cannot run: 3 heads on 2 ranks (needs H % N == 0)"
    assert refusal(4, 45, 2) == "cannot run: 45 tokens on 2 ranks (needs tokens % N == 0)"
    assert refusal(4, 64, 4) is None


def test_bench_flags_for_the_wan_row() -> None:
    from dsp_plugin.bench.__main__ import parse_args

    assert parse_args(["--wan-only"]).wan_only and parse_args(["--no-wan"]).no_wan
    for bad in (["--wan-only", "--no-wan"], ["--wan-only", "--scale-only"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
