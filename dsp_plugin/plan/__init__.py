"""Plans: make a model DSP-parallel from outside, with one entry point.

    model = dsp_plugin.parallelize(model, group=g)      # a built-in plan, found from the class
    model = dsp_plugin.parallelize(model, {"blocks.*": Block(...), ...})

See ``spec`` for the vocabulary, ``runtime`` for what the hooks do, ``builtin``
for the plans of the reference STDiT, Latte, SVD's spatio-temporal transformer
and Wan, and docs/models.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dsp_plugin.plan.frames import OnShard, sharded_io
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Layout, Positions, Split

__all__ = ["Block", "Gather", "Grid", "Heads", "Layout", "OnShard", "Positions", "Split", "parallelize", "sharded_io"]


def parallelize(model: nn.Module, plan: Any = None, group: Any = None, *, comm_dtype: Any = None) -> nn.Module:
    """``model`` made DSP-parallel over ``group`` (None: the DSP group of the current topology; a process group, or
    a 1-D ``DeviceMesh`` such as ``mesh["dsp"]``, whose process group the plan keeps).

    Replicated in, replicated out, the model's call signature and its own
    parameters. ``plan``: a dict ``{module path: spec or [specs]}``; None looks
    for the model's ``_dsp_plan`` attribute, then a built-in plan for its class.
    Hooks are registered in place and the model is returned. ``comm_dtype="fp8"``: every switch
    and head switch sends FP8 with a scale per chunk, forward and backward (``dsp_plugin.comm.payload``),
    except a ``Block(exact=True)``'s and the tensors a ``Heads(exact=...)`` names.
    """
    from dsp_plugin.comm.group_resolution import as_process_group
    from dsp_plugin.plan.builtin import builtin_plan
    from dsp_plugin.plan.runtime import apply_plan

    group = as_process_group(group, "parallelize")  # a mesh dim: resolved once, before any hook or collective
    if plan is None:
        plan = builtin_plan(model)
    if plan is None:
        name = type(model).__name__
        raise ValueError(f"parallelize: no built-in plan for {name}; pass plan= (docs/models.md, 'a plan "
                         f"for your own model') or set {name}._dsp_plan")
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: plan must be a dict {{module path: spec}}, got {type(plan).__name__}")
    return apply_plan(model, plan, group, comm_dtype=comm_dtype)
