"""``python -m dsp_plugin.bench.cp_plan_models``'s function at N=2 on its smallest shapes, in one run of the pool.

For each diffusers model with a ``_cp_plan`` (``bench.cp_plan_models.MODELS``, fp64): our built-in plan equals the
unmodified model on one process, diffusers' own Ulysses does where it runs, and our all-to-all bytes per layer are
at most diffusers' with the counts measured (docs/benchmarks.md, "The models with a diffusers `_cp_plan`").
"""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

# fp64 throughout but for the models' own fp32 islands (Wan's adaLN modulation, ChronoEdit's and Helios' norms,
# MiniMax-H3's RoPE), which see the same values on a shard as in one process: measured 0 to 4.4e-16
EXACT = 1e-12
# (our all-to-alls per layer, diffusers' all-to-alls per layer): the head switch (q, k, v packed; the output back)
# against one all-to-all each for q, k, v and the output; MiniMax-H3's diffusers count includes its text refiner
# layer (Ulysses there too: 3 attentions over 2 layers)
COUNTS = {"Wan": (2, 4), "ChronoEdit": (2, 4), "Helios": (2, 4), "MiniMax-H3": (2, 6), "Flux": (None, 4)}
# our gathers: the exit, and LTX-2's video keys its audio queries read (one per layer)
GATHERS = {"LTX-2": 3}


def test_cp_plan_models_bench_at_two_ranks() -> None:
    from dsp_plugin.bench.cp_plan_models import MODELS, combine, measure

    rows = combine(run_distributed(measure, 2, list(MODELS), True, "float64", timeout=120))
    assert list(rows) == list(MODELS)
    for label, row in rows.items():
        print(label, {k: v for k, v in row.items() if k != "lengths"})
        layers = row["layers"]
        if label == "Flux":  # joint attention: a plan derived from a _cp_plan cannot serve it, refused at
            # parallelize (plan/builtin/from_cp_plan.py; it used to fail at the first call on Split('txt_ids'))
            assert row["ours_refused"].startswith("parallelize: FluxTransformer2DModel has a _cp_plan but no "
                                                  "built-in plan, and its attention transformer_blocks.*.attn is "
                                                  "joint"), row
            theirs = row["diffusers"]
            assert theirs["max_diff"] <= EXACT and theirs["all_to_all"] / layers == COUNTS[label][1], theirs
            continue
        ours = row["ours"]
        assert ours["max_diff"] <= EXACT, (label, ours)
        assert ours["ops"] == {"all_to_all": (ours["all_to_all"], ours["a2a_bytes"]),
                               "all_gather": (GATHERS.get(label, 1), ours["gather_bytes"])}, (label, ours)
        theirs = row.get("diffusers") or row.get("diffusers_cut")
        if label in ("LTX-Video", "LTX-2"):  # its text mask, LTX-2's timestep per token: shapes of the full text
            assert theirs is None and row["diffusers_refused"].startswith("fails: RuntimeError"), (label, row)
            continue
        assert (ours["all_to_all"] / layers, theirs["all_to_all"] / layers) == COUNTS[label], (label, row)
        assert ours["a2a_bytes"] <= theirs["a2a_bytes"], (label, ours, theirs)
        if label == "Helios":  # its plan names blocks.0-39 (cut to the 2 here); its processor reads the history's
            # length as the shard's rows less the global new tokens (transformer_helios.py:132): wrong on a shard
            assert row["diffusers_refused"].startswith("cannot run: '2' is not a submodule"), row
            assert theirs["max_diff"] > 1e-3 and theirs["all_gather"] == 3 * layers, theirs
        else:
            assert theirs["max_diff"] <= EXACT, (label, theirs)
