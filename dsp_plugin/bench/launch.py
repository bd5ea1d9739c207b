"""Spawn N CPU gloo ranks for the bench and bring back each rank's result or the first error.

The same shape as the test harness (``tests/distributed.py``), kept inside the
package so ``python -m dsp_plugin.bench`` runs from an installed copy: one
thread per rank, a file store (no port to collide), a collective timeout so a
broken method fails instead of hanging, and ``destroy_process_group`` always.
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

COLLECTIVE_TIMEOUT_S = 120


def _rank_main(target: str, rank: int, world_size: int, init_file: str, results: Any,
               args: tuple[Any, ...]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    module, _, name = target.partition(":")
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def spawn(target: str, world_size: int, *args: Any, timeout: float = 900) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; values by rank.

    ``target`` is ``"module:function"``, imported in the ranks only, so the parent
    never imports torch.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    values: dict[int, Any] = {}
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(target, r, world_size, init_file, results, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(values) + len(errors) < world_size:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                        errors.append(f"a rank exited with codes {[p.exitcode for p in procs]}")
                        break
                    if time.monotonic() > deadline:
                        errors.append(f"ranks {sorted(set(range(world_size)) - set(values))} "
                                      f"did not finish within {timeout}s")
                        break
                    continue
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
        raise RuntimeError("bench failed:\n" + "\n".join(errors))
    return [values[r] for r in range(world_size)]
