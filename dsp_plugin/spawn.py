"""Run a function on N local gloo processes and bring back each rank's value or the first error.

What the bench and the test suite share: one CPU thread per rank, a file store
(no port to collide), a collective timeout so a bug fails instead of hanging,
``destroy_process_group`` whatever happens, a worker's exception re-raised in the
parent with its rank and traceback, and a rank that dies without reporting
noticed at once rather than at the deadline.

Ranks meet at the store after ``init_process_group`` (so no rank can leave while
a peer is still connecting) and, by default, after the function (so no rank
tears gloo down under a peer that still needs it). Those are store waits, not
collectives: the library's collectives stay in ``dsp_plugin.comm``.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["SpawnError", "collect", "run_rank", "spawn"]


class SpawnError(RuntimeError):
    """A rank raised, died or timed out; the message carries its rank and traceback."""


def _meet(store: Any, name: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(world_size)], timeout)


def run_rank(fn: Callable[..., Any] | str, rank: int, world_size: int, init_file: str, args: tuple[Any, ...],
             collective_timeout_s: float, final_barrier: bool, backend: str) -> tuple[str, Any]:
    """One rank's part of a run: the process group, ``fn(rank, world_size, *args)``, teardown.

    Returns ``("ok", value)`` or ``("error", text)`` (the exception and its traceback); never raises. The
    process group is destroyed and the topology uninstalled whatever happens, so the calling process can
    run another (the test suite's rank pool does, one run per test).
    """
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=collective_timeout_s)
    try:
        if isinstance(fn, str):  # "module:function", imported in the ranks only
            module, _, name = fn.partition(":")
            fn = getattr(importlib.import_module(module), name)
        if backend == "auto":  # NCCL and GPU ``rank`` when CUDA is present (dsp_plugin.backend)
            from dsp_plugin.backend import choose

            chosen = choose(local_rank=rank)
            if chosen.device.type == "cuda":
                torch.cuda.set_device(chosen.device)
            backend = chosen.backend
        store = dist.FileStore(init_file, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            _meet(store, "started", rank, world_size, timeout)
            failure: BaseException | None = None
            try:
                value = fn(rank, world_size, *args)
            except BaseException as exc:  # noqa: BLE001 - still check in, so healthy peers can leave
                failure = exc
            if final_barrier:
                try:
                    _meet(store, "finished", rank, world_size, timeout)
                except Exception:
                    if failure is None:
                        raise
            if failure is not None:
                raise failure
        finally:
            from dsp_plugin.topology import set_topology

            set_topology(None)
            if dist.is_initialized():   # a run may have torn its group down itself
                dist.destroy_process_group()
        return "ok", value
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def _rank_main(fn: Callable[..., Any] | str, rank: int, world_size: int, init_file: str, results: Any,
               args: tuple[Any, ...], collective_timeout_s: float, final_barrier: bool, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    status, value = run_rank(fn, rank, world_size, init_file, args, collective_timeout_s, final_barrier, backend)
    results.put((None, rank, status, value))


def collect(results: Any, procs: list[Any], timeout: float,
            task: object = None) -> tuple[dict[int, Any], list[str], bool]:
    """Wait for one report ``(task, rank, status, value)`` per process in ``procs``; stale tasks' reports are dropped.

    Returns the values by rank, the errors (a rank's exception with its traceback, ranks that exited
    without reporting: killed, segfault, noticed at once rather than at the deadline; ranks still running
    after ``timeout`` seconds) and whether every rank reported. It returns at the first rank found dead or
    at the deadline: the caller must then kill what still runs before it reuses anything.
    """
    world_size = len(procs)
    values: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(reported) < world_size:
        try:
            of, rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:  # exited without reporting (killed, segfault): give stragglers a moment
                time.sleep(1)
                dead = [r for r in dead if results.empty()]
            if dead:
                errors.append(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]} "
                              "without reporting")
                break
            if time.monotonic() > deadline:
                errors.append(f"ranks {sorted(set(range(world_size)) - reported)} "
                              f"did not finish within {timeout}s")
                break
            continue
        if of != task:
            continue
        reported.add(rank)
        if status == "ok":
            values[rank] = value
        else:
            errors.append(f"rank {rank} raised {value}")
    return values, errors, len(reported) == world_size


def spawn(fn: Callable[..., Any] | str, world_size: int, *args: Any, timeout: float = 600,
          collective_timeout_s: float = 60, final_barrier: bool = True, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    ``fn`` is a module-level function or a ``"module:function"`` string; its
    arguments and return value must pickle. ``final_barrier=False`` is for runs
    that leave a rank stuck in a collective on purpose: the others must leave at
    once so the stuck one sees its peers gone. ``backend="auto"`` lets
    ``dsp_plugin.backend.choose`` pick NCCL and GPU ``rank`` when CUDA is present
    (the benches); the tests keep gloo.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        # not daemonic: a rank may start DataLoader workers; stragglers are killed below
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, init_file, results, args,
                                                      collective_timeout_s, final_barrier, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            values, errors, _ = collect(results, procs, timeout)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise SpawnError("\n".join(sorted(errors)))
    return [values[r] for r in range(world_size)]
