"""The bench's costs section (``python -m dsp_plugin.bench --costs``) runs and prints its rows: bf16 vs FP8 bytes
on the wire, the plan runtime's share of a Wan step by the clock and its cost against the hand-written Wan. Tiny
sizes; the compiled rows run in their own test (a first compiled call takes about a minute on 2 CPU cores).

Nothing here reads a time: timings are the bench's output, never a test's pass condition.
"""

from __future__ import annotations

import pytest

from dsp_plugin.bench import costs
from dsp_plugin.bench.__main__ import parse_args


def test_costs_section_runs_and_prints_its_rows(tmp_path) -> None:
    result = costs.run(2, quick=True, rounds=2, compiled=False, switch=(1, 2, 8, 64), heads=(1, 16, 4, 8),
                       size=(1, 2, 8, 2, 4))
    table = costs.markdown(result)
    print(table)
    for op in ("dynamic_switch", "to_heads", "from_heads"):
        r = result["wire"][op]
        # FP8: one byte per element instead of bf16's two, plus a float32 scale per chunk sent (N - 1 = 1 here)
        chunks = {"dynamic_switch": 1, "to_heads": 3, "from_heads": 1}[op]
        assert r["fp8_bytes"] == r["bf16_bytes"] // 2 + 4 * chunks, (op, r)
        assert r["all_to_alls"] == 1, (op, r)
        assert f"| {op}: bf16 (A) vs FP8 (B)" in table
    assert [r["mode"] for r in result["runtime"]] == ["forward", "train"]
    for r in result["runtime"]:
        # the hooks ran; no op went through the SDPA level (Wan attends through diffusers' dispatch, so after its
        # first call each Heads module runs without it: plan.runtime's _learn, tests/test_plan_sdpa_level.py)
        assert r["calls"] > 0 and r["mode_calls"] == 0, r
        assert 0 < r["plan_cpu_ms"] and r["share"] > 0, r
        # the clock's own reads were measured in the ranks and taken off the hooks' time
        assert r["plan_raw_cpu_ms"] > r["plan_cpu_ms"] and r["clock_us"]["plan_cpu"] > 0, r
    assert table.count("plan runtime's share of a Wan") == 2
    cost = result["runtime_cost"]  # the A/B against the hand-written Wan: 20 paired rounds, an interval around it
    assert cost["rounds"] == 20 and cost["plan_ms"] > 0 and cost["hand_ms"] > 0, cost
    assert cost["paired_interval"][0] <= cost["paired_share"] <= cost["paired_interval"][1], cost
    assert table.count("plan runtime's cost of a Wan forward") == 1
    written = costs.write(result, tmp_path)
    assert all(p.stat().st_size > 0 for p in written)


def test_compiled_plan_runtime_runs_a_few_calls_per_step() -> None:
    """The row of the plan runtime under ``torch.compile`` (aot_eager), at a tiny Wan: compiled, the hooks run
    inside the graph, and only the model's own hooks are Python left per step (the bench's Wan: 1424 calls
    eager, 18 compiled per forward). Counted, not timed."""
    from tests.distributed import run_distributed

    for rank, r in enumerate(run_distributed(costs._compiled_runtime_worker, 2, (1, 2, 8, 2, 4), timeout=600,
                                             collective_timeout_s=300, world_topology=False)):
        for mode in ("forward", "train"):
            calls = r[mode]["calls"]
            print(f"rank {rank} {mode}: Python calls into dsp_plugin per step {calls}")
            assert calls["eager"] > 200 and 0 < calls["compiled"] < 40, (mode, calls)


def test_costs_only_excludes_the_other_sections() -> None:
    assert parse_args(["--costs-only", "--quick"]).costs and parse_args(["--costs"]).costs  # --costs-only: an alias
    for other in ("--wan-only", "--scale-only", "--no-costs"):
        with pytest.raises(SystemExit):
            parse_args(["--costs-only", other])
    assert parse_args(["--costs", "--size", "4,12,16,8,16"]).size == (4, 12, 16, 8, 16)
    for bad in (["--costs", "--size", "4,12"], ["--size", "4,12,16,8,16"], ["--device", "cuda:0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
