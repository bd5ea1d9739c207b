"""A plan derived from a diffusers model's own ``_cp_plan`` (``plan/builtin/from_cp_plan.py``) equals one process.

``CPPlanDiT`` (``dsp_plugin.testing.cp_plan_model``) is a video DiT built from diffusers' Wan components that
declares diffusers' context-parallel plan and has no built-in DSP plan: ``parallelize(model)`` derives one and says
so in one log line. ChronoEdit's and MiniMax-H3's own ``_cp_plan`` derive plans too (their built-in plans bypassed).
Oracle: the unmodified model on one process, fp64, 2 and 4 ranks, 45 tokens (uneven), 3 heads (on 4 ranks one rank
holds none); output, input gradient and every parameter gradient summed over the group; collectives counted.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def _case(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    from dsp_plugin.testing.cp_plan_model import cp_plan_case
    from dsp_plugin.testing.tiny_video import case, cast

    if name == "cp-plan-dit":
        model, kwargs = cp_plan_case()
        return model.double(), cast(kwargs, torch.float64)
    return case(name, torch.float64)


def _derived(rank: int, n: int, name: str) -> dict[str, Any]:

    import dsp_plugin
    from dsp_plugin.plan.builtin import plan_from_cp_plan
    from tests.test_plan_models import forward_backward

    reference, kwargs = _case(name)
    model = copy.deepcopy(reference)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("dsp_plugin.plan")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:  # no built-in plan: derived by parallelize; the others: their own _cp_plan, their built-in bypassed
        model = dsp_plugin.parallelize(model) if name == "cp-plan-dit" else \
            dsp_plugin.parallelize(model, plan_from_cp_plan(model))
    finally:
        log.removeHandler(handler)
    def call(m: torch.nn.Module, kw: dict) -> list[torch.Tensor]:
        outs = m(**kw) if name == "cp-plan-dit" else m(**kw, return_dict=False)
        return [outs] if isinstance(outs, torch.Tensor) else list(outs)

    (outs_ref, dx_ref), (outs, dx, acct) = forward_backward(reference, model, kwargs, call)
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    return {"out": max(_relative(o, r) for o, r in zip(outs, outs_ref)), "dx": _relative(dx, dx_ref),
            "grads": max((g - r).abs().max().item() for g, r in pairs) / max(r.abs().max().item() for _, r in pairs),
            "counts": (acct.count("all_to_all", "forward"), acct.count("all_to_all", "backward"),
                       acct.count("all_gather", "forward"), acct.count("reduce_scatter", "backward"), acct.count()),
            "log": lines}


# (forward all-to-alls, backward all-to-alls, forward all_gathers, backward reduce-scatters, all collectives): the head
# switch on each self-attention (2 layers: attn1), cross-attention to the text local; the gathers diffusers declares
# (MiniMax-H3: its video and audio heads, each with a reduce-scatter backward: two gathers of one activation)
COUNTS = {"cp-plan-dit": (4, 4, 1, 0, 9), "tiny-chronoedit": (4, 4, 1, 0, 9), "tiny-minimax-h3": (4, 4, 2, 2, 12)}


def _every_derived(rank: int, n: int, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: _derived(rank, n, name) for name in names}  # one run of the rank pool for the cases


# every case on 2 ranks in one run; on 4 ranks (uneven tokens: 12+11+11+11; rank 3 holds no head) the model whose plan
# parallelize derives itself (ChronoEdit's and MiniMax-H3's derived plans switch and gather as it does)
RUNS = {2: ["cp-plan-dit", "tiny-chronoedit", "tiny-minimax-h3"], 4: ["cp-plan-dit"]}


@pytest.mark.parametrize("n", list(RUNS))
def test_plan_derived_from_cp_plan_equals_one_process(n: int) -> None:
    for rank, by_name in enumerate(run_distributed(_every_derived, n, RUNS[n], timeout=300)):
        assert list(by_name) == RUNS[n], by_name
        for name, d in by_name.items():
            print(f"{name} n={n} rank {rank}: {d}")
            # fp32 inside (Wan's adaLN modulation, MiniMax-H3's RoPE and heads): 1e-6 relative
            assert max(d["out"], d["dx"], d["grads"]) < 1e-6, (name, rank, d)
            assert d["counts"] == COUNTS[name], (name, rank, d)
            if name == "cp-plan-dit":  # one line, naming the class and what was derived
                assert len(d["log"]) == 1 and "no built-in plan for CPPlanDiT; derived one from its diffusers " \
                    "_cp_plan" in d["log"][0] and d["log"][0].endswith("where diffusers uses Ulysses (blocks.*.attn1)"), \
                    d["log"]


def test_derived_plan_puts_the_head_switch_where_diffusers_uses_ulysses() -> None:
    """No processes: the derived plan of ``CPPlanDiT`` in full. The text split diffusers declares at ``blocks.0`` is
    left out (the text stays whole), self-attention (``attn1``) gets the head switch, cross-attention (``attn2``)
    none; RoPE's two outputs are one ``Split("out")``."""
    from dsp_plugin.plan import Block, Gather, Heads, Split
    from dsp_plugin.plan.builtin import builtin_plan
    from dsp_plugin.testing.cp_plan_model import cp_plan_case

    plan = builtin_plan(cp_plan_case()[0])
    assert sorted(plan) == ["blocks.*", "blocks.*.attn1", "blocks.0", "proj_out", "rope"], plan
    assert isinstance(plan["rope"], Split) and plan["rope"].arg == "out" and plan["rope"].shard == "L"
    assert isinstance(plan["blocks.0"], Split) and plan["blocks.0"].arg == "hidden_states"
    assert isinstance(plan["blocks.*"], Block) and isinstance(plan["blocks.*.attn1"], Heads)
    assert isinstance(plan["proj_out"], Gather) and not plan["proj_out"].partial_grad


def test_cp_plan_that_cannot_be_derived_is_refused_naming_the_entry() -> None:
    """No processes: a token split whose blocks are not known, and an input without ``expected_dims``, are refused at
    ``parallelize``, naming the entry, before any hook or collective."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    import dsp_plugin
    from dsp_plugin.testing.cp_plan_model import CPPlanDiT

    class Elsewhere(CPPlanDiT):
        _cp_plan = {"patch": {"hidden_states": ContextParallelInput(split_dim=2, expected_dims=5)}}

    class Shapeless(CPPlanDiT):
        _cp_plan = {"blocks.0": {"hidden_states": ContextParallelInput(split_dim=1)}}

    with pytest.raises(ValueError, match=r"_cp_plan splits 'hidden_states' at 'patch', and which blocks it feeds is "
                                         r"not known.*pass plan="):
        dsp_plugin.parallelize(Elsewhere())
    with pytest.raises(ValueError, match=r"_cp_plan entry 'blocks.0'\['hidden_states'\]: expected_dims is None"):
        dsp_plugin.parallelize(Shapeless())
