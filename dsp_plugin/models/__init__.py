"""Reference multi-dimensional transformer (single-device code) and the DSP plan that parallelizes it."""

from __future__ import annotations

from dsp_plugin.models.plan import DSPPlan, parallelize, switch_schedule
from dsp_plugin.models.stdit import AxialBlock, STDiT, STDiTConfig

__all__ = ["AxialBlock", "DSPPlan", "STDiT", "STDiTConfig", "parallelize", "switch_schedule"]
