"""Adapters: DSP for models this project did not write (diffusers' Latte, SVD's spatio-temporal transformer).

``LatteDSP`` and ``SpatioTemporalDSP`` wrap the models' built-in plans
(``dsp_plugin.plan.builtin``, hooks); ``LatteDSP.forward_shard`` keeps latents
sharded across a sampling loop (the samplers are in ``dsp_plugin.pipelines``, which
builds on this package, not the other way). ``Sharded`` is for a
forward written by hand where hooks cannot reach a model: a view in the plan
vocabulary (split at entry, a switch before each block that needs one,
fold/unfold with local lengths between blocks, gather at exit). The model file
is not edited and its parameters stay the model's. See docs/models.md.

Importing this package needs torch only; each adapter imports diffusers when built.
"""

from __future__ import annotations

from dsp_plugin.adapters.sharded import Sharded, check_divisible_lengths

__all__ = ["LatteDSP", "Sharded", "SpatioTemporalDSP", "check_divisible_lengths"]


def __getattr__(name: str):  # noqa: ANN202 - lazy, so `import dsp_plugin.adapters` does not import diffusers
    if name == "LatteDSP":
        from dsp_plugin.adapters.latte import LatteDSP

        return LatteDSP
    if name == "SpatioTemporalDSP":
        from dsp_plugin.adapters.spatiotemporal import SpatioTemporalDSP

        return SpatioTemporalDSP
    if name in ("parallelize_latte_pipeline", "parallelize_wan_pipeline", "sampling_groups"):
        raise AttributeError(f"dsp_plugin.adapters.{name} moved: import it from dsp_plugin.pipelines (the samplers "
                             f"build on the adapters, so the adapters no longer import them)")
    raise AttributeError(f"module 'dsp_plugin.adapters' has no attribute {name!r}")
