"""Adapters: DSP for models this project did not write (diffusers' Latte, SVD's spatio-temporal transformer).

``LatteDSP`` and ``SpatioTemporalDSP`` wrap the models' built-in plans
(``dsp_plugin.plan.builtin``, hooks); ``LatteDSP.forward_shard`` and the Latte
pipeline keep latents sharded across a sampling loop. ``Sharded`` is for a
forward written by hand where hooks cannot reach a model: a view in the plan
vocabulary (split at entry, a switch before each block that needs one,
fold/unfold with local lengths between blocks, gather at exit). The model file
is not edited and its parameters stay the model's. See docs/models.md.

Importing this package needs torch only; each adapter imports diffusers when built.
"""

from __future__ import annotations

from dsp_plugin.adapters.sharded import Sharded, check_divisible_lengths

__all__ = ["LatteDSP", "Sharded", "SpatioTemporalDSP", "check_divisible_lengths", "parallelize_latte_pipeline",
           "parallelize_wan_pipeline", "sampling_groups"]


def __getattr__(name: str):  # noqa: ANN202 - lazy, so `import dsp_plugin.adapters` does not import diffusers
    if name == "LatteDSP":
        from dsp_plugin.adapters.latte import LatteDSP

        return LatteDSP
    if name == "SpatioTemporalDSP":
        from dsp_plugin.adapters.spatiotemporal import SpatioTemporalDSP

        return SpatioTemporalDSP
    if name in ("parallelize_latte_pipeline", "sampling_groups"):
        from dsp_plugin.adapters import pipeline

        return getattr(pipeline, name)
    if name == "parallelize_wan_pipeline":
        from dsp_plugin.adapters.pipeline_wan import parallelize_wan_pipeline

        return parallelize_wan_pipeline
    raise AttributeError(f"module 'dsp_plugin.adapters' has no attribute {name!r}")
