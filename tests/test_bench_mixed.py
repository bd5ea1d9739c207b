"""The mixed-model bench (dsp_plugin.bench.mixed): measured all-to-alls and bytes equal the formula.

Factorized and full-attention blocks under DSP (switches + the head switch), with
q, k, v apart (diffusers-style), and Ulysses everywhere, on 2 gloo ranks; every
strategy's output equals the one-process model.
"""

from __future__ import annotations

from dsp_plugin.bench.mixed import STRATEGIES, dsp_switches, formula, markdown, worker
from tests.distributed import run_distributed

PATTERN = ("full", "spatial", "temporal", "full", "temporal")
SHAPE, HEADS = (1, 4, 6, 8), 2  # B, T, S, D


def test_measured_equals_the_formula_and_outputs_match() -> None:
    n = 2
    results = run_distributed(worker, n, PATTERN, SHAPE, HEADS, 0)
    activation = 8 * 1 * 4 * 6 * 8  # fp64
    # entry on T (other of the first factorized block, spatial); temporal switches to S; the last temporal
    # block arrives on S already: one switch
    assert dsp_switches(PATTERN) == 1
    for rank_results in results:
        for strategy in STRATEGIES:
            row = rank_results[strategy]
            count, nbytes = formula(strategy, PATTERN, n, activation)
            for phase in ("forward", "backward"):
                assert row[phase]["count"] == count, (strategy, phase, row)
                assert row[phase]["bytes"] == nbytes, (strategy, phase, row)
            assert row["max_diff"] < 1e-12, (strategy, row)
    dsp = results[0]
    assert dsp["dsp"]["forward"]["count"] == 1 + 2 * 2 and dsp["dsp_apart"]["forward"]["count"] == 1 + 4 * 2
    assert dsp["dsp"]["forward"]["bytes"] < dsp["ulysses"]["forward"]["bytes"]
    table = markdown(dsp, PATTERN, n, SHAPE, HEADS)
    assert "| ulysses_apart | 20 / 20 |" in table
