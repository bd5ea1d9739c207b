"""Environment tweaks for DeepSpeed used by both the integration and the Ulysses baseline.

It sits below both, so the baselines need not import the integration (the arrows
run ``comm <- models/baselines <- megatron/deepspeed``). DeepSpeed is imported
lazily, only when a function is called.
"""

from __future__ import annotations

import os

__all__ = ["SHM_ENV", "skip_cpu_shm_build"]

#: Set to 1 to let DeepSpeed build its CPU shared-memory all-reduce op (inference only).
SHM_ENV = "DSP_DEEPSPEED_SHM"


def skip_cpu_shm_build() -> bool:
    """Keep DeepSpeed from JIT-compiling ``deepspeed_shm_comm`` on the CPU accelerator.

    ``deepspeed.comm.TorchBackend`` builds that op (about 30-60 s on a cold
    cache) on every CPU init, but only ``inference_all_reduce`` uses it.
    DeepSpeed gates the build on ``deepspeed.ops.__compatible_ops__``, a dict
    that is computed once and documented to keep edits, so marking the op
    incompatible is the supported switch. Returns whether it was skipped; must
    run before DeepSpeed's communication backend is created.
    """
    if os.environ.get(SHM_ENV, "0") == "1":
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True
