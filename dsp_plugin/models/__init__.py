"""Reference multi-dimensional transformer (single-device code); ``dsp_plugin.parallelize`` makes it DSP-parallel
with its built-in plan (``dsp_plugin.plan.builtin.stdit_plan``)."""

from __future__ import annotations

from dsp_plugin.models.stdit import AxialBlock, STDiT, STDiTConfig
from dsp_plugin.plan.schedule import switch_schedule

__all__ = ["AxialBlock", "STDiT", "STDiTConfig", "switch_schedule"]


def __getattr__(name: str) -> object:
    if name in ("parallelize", "DSPPlan"):
        raise AttributeError(f"dsp_plugin.models.{name} is gone: one plan runtime serves every model, the STDiT "
                             f"included; use dsp_plugin.parallelize(model) (its built-in plan is "
                             f"dsp_plugin.plan.builtin.stdit_plan)")
    raise AttributeError(f"module 'dsp_plugin.models' has no attribute {name!r}")
