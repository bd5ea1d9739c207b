"""Hooks for megatron-core 0.19.x packaging gaps that hit any ``megatron.training`` launch.

``initialize_megatron`` -> ``_compile_dependencies`` runs ``make`` in
``megatron/core/datasets`` on rank 0 and exits the job when it fails. The
megatron-core wheel ships the compiled ``helpers_cpp`` extension but no
Makefile, so every pip-installed launch dies there (GPU or CPU). The hook
makes the compile step a no-op when the prebuilt extension imports, and
leaves it unchanged otherwise (a source checkout still compiles).

``load_checkpoint`` calls ``sys.exit()`` with status 0 on some load errors;
``fail_on_silent_exit_in_load`` makes that a failure of the launch.

``_compile_dependencies`` imports ``compile_helpers`` from the module at call
time, so replacing the module attribute is enough; no patch file is needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["exit_is_failure", "fail_on_silent_exit_in_load", "use_prebuilt_dataset_helpers"]


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


@contextlib.contextmanager
def exit_is_failure(what: str) -> Iterator[None]:
    """Turn a ``sys.exit()`` without an error status inside the block into a ``RuntimeError``."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise RuntimeError(f"{what} called sys.exit() without an error status; see the message above") from exc
        raise


def fail_on_silent_exit_in_load() -> None:
    """Megatron's ``load_checkpoint`` calls ``sys.exit()`` (status 0) on some load errors (e.g. "Unable to
    load rng state"); a launch that did not load must fail. Wraps the name ``train()`` and
    ``setup_model_and_optimizer`` call; idempotent. ``train()``'s own ``sys.exit(0)`` after
    ``--exit-interval``/``--exit-duration-in-mins`` is a success and stays one."""
    from megatron.training import training

    if getattr(training.load_checkpoint, "_exit_is_failure", False):
        return
    original = training.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with exit_is_failure("loading the checkpoint"):
            return original(*args, **kwargs)

    load_checkpoint._exit_is_failure = True  # type: ignore[attr-defined]
    training.load_checkpoint = load_checkpoint
