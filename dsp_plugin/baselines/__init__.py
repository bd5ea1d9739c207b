"""The sequence-parallel methods DSP is compared with (paper section 4, appendix A.2).

Each ``parallelize_*`` takes the single-device reference model and applies the
method from outside, in place, as ``dsp_plugin.parallelize`` does for
DSP. Importing this package needs torch only; Ulysses imports DeepSpeed when
it is applied. ``ulysses`` is the best practice (temporal blocks only, DeepSpeed's
``DistributedAttention``); ``ulysses_paper`` is what the paper's harness ran
(all-to-alls around every attention, see its module docstring).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dsp_plugin.baselines.megatron_sp import parallelize_megatron_sp
from dsp_plugin.baselines.ring import parallelize_ring
from dsp_plugin.baselines.ulysses import parallelize_ulysses
from dsp_plugin.baselines.ulysses_paper import parallelize_ulysses_paper

__all__ = ["PARALLELIZE", "parallelize_megatron_sp", "parallelize_ring", "parallelize_ulysses",
           "parallelize_ulysses_paper"]

#: method name -> ``fn(model, *, group=None) -> model``
PARALLELIZE: dict[str, Callable[..., nn.Module]] = {
    "ulysses": parallelize_ulysses,
    "ulysses_paper": parallelize_ulysses_paper,
    "megatron_sp": parallelize_megatron_sp,
    "ring": parallelize_ring,
}
