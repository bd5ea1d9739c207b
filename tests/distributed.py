"""The test suite's multi-process runner: gloo ranks on CPU, with test-sized timeouts.

Each rank runs on its own gloo process with one thread; a rank's exception is
re-raised here with its rank and traceback (``WorkerError``). The processes come
from the session's rank pool (``tests.pool``: started once per world size and
reused, a new process group per run); a run that must own its processes (one
that leaves a rank stuck in a collective, ``final_barrier=False``, or asks with
``own_processes=True``) gets new ones from ``dsp_plugin.spawn``, as does every run
when ``DSP_TEST_POOL=0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from dsp_plugin.spawn import SpawnError as WorkerError
from dsp_plugin.spawn import spawn

__all__ = ["COLLECTIVE_TIMEOUT_S", "WorkerError", "assert_no_steady_state_checks", "run_distributed"]

COLLECTIVE_TIMEOUT_S = 60


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                    final_barrier: bool = True, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                    own_processes: bool = False, world_topology: bool = True) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the values by rank.

    ``fn`` must be defined at module level; arguments and return value must pickle.
    ``final_barrier=False``: see ``dsp_plugin.spawn.spawn`` (such a run gets its own
    processes). Each rank starts with ``Topology.world()`` installed (the whole world
    is the DSP group, so ``group=None`` shards over it), or none with
    ``world_topology=False``; a worker may install another. ``timeout`` bounds the
    whole run: past it the ranks are killed.
    """
    body, args = ((_in_world_topology, (fn, *args)) if world_topology else (fn, args))
    if own_processes or not final_barrier or os.environ.get("DSP_TEST_POOL", "1") == "0":
        return spawn(body, world_size, *args, timeout=timeout, collective_timeout_s=collective_timeout_s,
                     final_barrier=final_barrier)
    from tests.pool import pool

    return pool(world_size).run(body, *args, timeout=timeout, collective_timeout_s=collective_timeout_s)


def _in_world_topology(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())
    return fn(rank, world_size, *args)


def assert_no_steady_state_checks(check_records: list[Any], mode: str, what: str) -> None:
    """After the first step nothing is new: ``CommAccounting.check_records`` of a later step must be empty.

    A fingerprint exchange (``dsp_plugin.checks``) in the steady state is an all-gather and a host sync per
    primitive call: either a primitive lacked a length that a tag (``dsp_plugin.layout``) should have carried,
    so it asked the group, or the check mode is not the default ``first``.
    """
    assert mode == "first", f"{what}: the check mode is {mode!r}; with DSP_CHECK unset it must be 'first'"
    assert not check_records, (
        f"{what}: {len(check_records)} fingerprint exchange(s) in a steady-state step ({check_records}); "
        f"in check mode 'first' a repeated call exchanges nothing unless it lacks a global length: "
        f"a length tag was lost between blocks, so the primitives asked the group for the length")
