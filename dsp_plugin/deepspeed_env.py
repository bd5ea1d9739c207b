"""What the DeepSpeed integration and the Ulysses baseline need from DeepSpeed's environment.

It sits below both, so the baselines need not import the integration (the arrows
run ``comm <- models/baselines <- megatron/deepspeed``). DeepSpeed is imported
lazily, only when a function is called.

**The tested range.** The DSP path leans on DeepSpeed behaviour that no public
API promises:

- ZeRO-3's reduce-scatter divides by DP x DSP, ignoring ``sequence_parallel_size``
  (``deepspeed/gradients.py`` multiplies local gradients by the DSP size);
- ``deepspeed.initialize`` converts a plain module for ZeRO-3 over
  ``mpu.get_data_parallel_group()`` and skips its precision cast for a module
  that ``zero.Init`` already converted (``deepspeed/gradients.py``);
- stages 0-2 reduce over ``mpu.get_sequence_data_parallel_group()`` and divide by
  DP (``deepspeed/mpu.py``);
- ``deepspeed.ops.__compatible_ops__`` gates the CPU shared-memory op build
  (``skip_cpu_shm_build``).

``tests/test_deepspeed_convention.py`` and ``tests/test_deepspeed_gradients.py``
pin all of it. Outside ``TESTED_RANGE`` the DSP path refuses to start
(``require_tested_deepspeed``) rather than train with a silently wrong gradient
scale, and ``skip_cpu_shm_build`` leaves DeepSpeed's private dict alone.
``pyproject.toml`` pins the same range.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = ["SHM_ENV", "TESTED_RANGE", "deepspeed_version_is_tested", "require_tested_deepspeed",
           "skip_cpu_shm_build"]

#: Set to 1 to let DeepSpeed build its CPU shared-memory all-reduce op (inference only).
SHM_ENV = "DSP_DEEPSPEED_SHM"
#: ``(lowest, first untested)``: DeepSpeed versions ``lowest <= v < first untested``.
TESTED_RANGE = ("0.19.8", "0.19.9")


def _installed() -> str:
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        raise RuntimeError("dsp_plugin.deepspeed needs DeepSpeed: pip install -e '.[deepspeed]' "
                           "-c constraints.txt") from None


def deepspeed_version_is_tested(installed: str | None = None) -> bool:
    """Whether ``installed`` (default: the installed DeepSpeed) lies in ``TESTED_RANGE`` (local tags ignored)."""
    release = Version(Version(installed or _installed()).base_version)
    return Version(TESTED_RANGE[0]) <= release < Version(TESTED_RANGE[1])


def require_tested_deepspeed(installed: str | None = None) -> None:
    """Raise a ``RuntimeError`` naming the version and the range unless DeepSpeed is in ``TESTED_RANGE``."""
    found = installed or _installed()
    if not deepspeed_version_is_tested(found):
        low, high = TESTED_RANGE
        raise RuntimeError(
            f"dsp_plugin.deepspeed: DeepSpeed {found} is outside the tested range >={low},<{high}. The DSP path "
            f"depends on DeepSpeed internals that change between releases (ZeRO-3's reduce-scatter divisor, "
            f"zero.Init's precision cast, the mpu getters ZeRO queries); with another version the gradient scale "
            f"could be silently wrong. Install deepspeed=={low} (constraints.txt), or re-measure with "
            f"'python -m tests.test_deepspeed_convention' and pytest tests/test_deepspeed_*.py, then widen "
            f"TESTED_RANGE in dsp_plugin/deepspeed_env.py and pyproject.toml.")


def skip_cpu_shm_build() -> bool:
    """Keep DeepSpeed from JIT-compiling ``deepspeed_shm_comm`` on the CPU accelerator.

    ``deepspeed.comm.TorchBackend`` builds that op (about 30-60 s on a cold
    cache) on every CPU init, but only ``inference_all_reduce`` uses it.
    DeepSpeed gates the build on ``deepspeed.ops.__compatible_ops__``, a dict
    that is computed once and documented to keep edits, so marking the op
    incompatible is the switch (private: done only inside ``TESTED_RANGE``,
    elsewhere the op is built as usual). Returns whether it was skipped; must
    run before DeepSpeed's communication backend is created.
    """
    if os.environ.get(SHM_ENV, "0") == "1" or not deepspeed_version_is_tested():
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True
