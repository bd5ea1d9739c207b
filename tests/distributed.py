"""Run a function on N gloo processes on CPU and bring back results or the first error.

Each worker: one thread, ``init_process_group("gloo")`` through a file store (no
ports to collide), a collective timeout so a bug fails fast, and
``destroy_process_group`` whatever happens. A worker's exception is re-raised
in the test with its rank and traceback; a worker that hangs is killed after
``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

COLLECTIVE_TIMEOUT_S = 60


class WorkerError(RuntimeError):
    """A worker raised; the message carries its rank and traceback."""


def _worker(fn: Callable[..., Any], rank: int, world_size: int, init_file: str,
            results: Any, args: tuple, final_barrier: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            dist.barrier()   # every pair connected before anyone can leave
            value = fn(rank, world_size, *args)
            if final_barrier:  # nobody tears gloo down while a peer still needs it
                dist.barrier()
        finally:
            from dsp_plugin.topology import set_topology

            set_topology(None)
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                    final_barrier: bool = True) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    ``final_barrier=False`` is for tests that leave a rank stuck in a collective on
    purpose: the others must leave at once so the stuck one sees its peers gone.

    ``fn`` must be importable (defined at module level) and its arguments and
    return value picklable.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init_file, results, args, final_barrier), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        errors: list[str] = []
        reported: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(reported) < world_size:
                try:
                    rank, status, value = results.get(timeout=0.5)
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
                        missing = sorted(set(range(world_size)) - reported)
                        errors.append(f"ranks {missing} did not finish within {timeout}s")
                        break
                    continue
                reported.add(rank)
                if status == "ok":
                    values[rank] = value
                else:
                    errors.append(f"rank {rank} raised {value}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise WorkerError("\n".join(sorted(errors)))
    return [values[r] for r in range(world_size)]
