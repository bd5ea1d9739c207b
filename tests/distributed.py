"""The test suite's multi-process runner: ``dsp_plugin.spawn`` with test-sized timeouts.

Each worker runs on its own gloo process on CPU with one thread; a worker's
exception is re-raised here with its rank and traceback (``WorkerError``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsp_plugin.spawn import SpawnError as WorkerError
from dsp_plugin.spawn import spawn

__all__ = ["COLLECTIVE_TIMEOUT_S", "WorkerError", "run_distributed"]

COLLECTIVE_TIMEOUT_S = 60


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                    final_barrier: bool = True) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the values by rank.

    ``fn`` must be defined at module level; arguments and return value must pickle.
    ``final_barrier=False``: see ``dsp_plugin.spawn.spawn``.
    """
    return spawn(fn, world_size, *args, timeout=timeout, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                 final_barrier=final_barrier)
