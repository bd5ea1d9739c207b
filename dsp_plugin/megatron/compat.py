"""Hooks for megatron-core 0.19.x packaging gaps that hit any ``megatron.training`` launch.

``initialize_megatron`` -> ``_compile_dependencies`` runs ``make`` in
``megatron/core/datasets`` on rank 0 and exits the job when it fails. The
megatron-core wheel ships the compiled ``helpers_cpp`` extension but no
Makefile, so every pip-installed launch dies there (GPU or CPU). The hook
makes the compile step a no-op when the prebuilt extension imports, and
leaves it unchanged otherwise (a source checkout still compiles).

``_compile_dependencies`` imports ``compile_helpers`` from the module at call
time, so replacing the module attribute is enough; no patch file is needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["use_prebuilt_dataset_helpers"]


def use_prebuilt_dataset_helpers() -> Callable[[], None]:
    """Install the hook; returns the original ``compile_helpers``."""
    from megatron.core.datasets import utils

    original = getattr(utils.compile_helpers, "__wrapped__", utils.compile_helpers)

    def compile_helpers() -> None:
        """Build the dataset helpers unless the wheel's prebuilt extension is importable."""
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            original()

    compile_helpers.__wrapped__ = original  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers
    return original
