"""DeepSpeed integration: the config key, ``initialize``, and a DSP-aware model.

``"sequence_parallel_mode": "dsp"`` with ``"sequence_parallel_size": N`` in the
DeepSpeed JSON config, ``from dsp_plugin.deepspeed import initialize`` in place
of ``deepspeed.initialize``, and a model whose forward shards the sequence
(``dsp_plugin.parallelize`` or the primitives). See ``docs/deepspeed.md``.
Importing this package imports DeepSpeed; ``import dsp_plugin`` does not.
"""

from __future__ import annotations

from dsp_plugin.deepspeed.config import MODE_KEY, SIZE_KEY, DSPSettings, parse_dsp_config
from dsp_plugin.deepspeed.engine import initialize, load_config, skip_cpu_shm_build
from dsp_plugin.deepspeed.gradients import gradient_scale
from dsp_plugin.deepspeed.guard import GUARD_ENV, DSPGuardError
from dsp_plugin.deepspeed.mpu import DeepSpeedMPU

__all__ = [
    "GUARD_ENV",
    "MODE_KEY",
    "SIZE_KEY",
    "DSPGuardError",
    "DSPSettings",
    "DeepSpeedMPU",
    "gradient_scale",
    "initialize",
    "load_config",
    "parse_dsp_config",
    "skip_cpu_shm_build",
]
