"""``python -m dsp_plugin.bench.switch``: one DSP switch against a bare ``all_to_all_single``, side by side.

    python -m dsp_plugin.bench.switch                      # N = 2 and 4, shards of 4 and 8 MiB
    python -m dsp_plugin.bench.switch --nproc 2 --mib 8 --reps 30
    python -m dsp_plugin.bench.switch --compare-with old_comm.py   # also time another dynamic_switch (before/after)

Per N and shard size, the median over ``--reps`` interleaved repetitions of:

- ``bare``: ``all_to_all_single`` of the shard's bytes from a ready buffer (the floor);
- ``switch``: ``dynamic_switch`` S(T) -> S(S) of ``[B=2, T/N, S, D]`` fp32 (one pack, one unpack copy);
- ``switch [1,..]``: the same bytes as ``[1, 2T/N, S, D]``, where the blocks already lie in order
  (no pack copy, no unpack copy);
- ``switch always`` / ``switch off``: with ``DSP_CHECK=always`` (a fingerprint exchange before
  every call) and ``DSP_CHECK=off``; plain ``switch`` runs the default (``first``: checked once);
- ``fn(switch)`` / ``overlapped``: a per-token Linear after the switch, plain and with
  ``switch_apply(chunks=2)`` (the next chunk's all-to-all in flight while a chunk computes);
- ``old switch``: the ``dynamic_switch`` of the file given by ``--compare-with``.

On a CPU machine these are gloo numbers: they show copies and overheads relative to the
bare collective on the same machine in the same run, not GPU speed. With CUDA present the
ranks run on NCCL, one GPU each (``dsp_plugin.backend``; ``DSP_BACKEND=gloo`` forces the
CPU). Timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.spawn import spawn

HIDDEN, SPATIAL, BATCH = 64, 256, 2


def _load(path: str | None) -> Any:
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("dsp_compare_comm", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _worker(rank: int, n: int, mib: int, reps: int, compare_path: str | None) -> dict[str, float]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()                 # third-party notices stay out of the tables
    from dsp_plugin import checks
    from dsp_plugin.backend import current_device, synchronize
    from dsp_plugin.baselines.comm import bare_all_to_all
    from dsp_plugin.comm import dynamic_switch, switch_apply
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())   # the whole world is the DSP group (group=None refuses without one)
    device = current_device()
    old = _load(compare_path)
    frames_local = mib * 2**20 // (4 * BATCH * SPATIAL * HIDDEN)
    frames = frames_local * n
    x = torch.randn(BATCH, frames_local, SPATIAL, HIDDEN, device=device)    # [B, T/N, S, D]
    x1 = x.reshape(1, BATCH * frames_local, SPATIAL, HIDDEN).clone()        # [1, 2T/N, S, D]
    flat = x.reshape(-1).clone()
    lin = torch.nn.Linear(HIDDEN, HIDDEN).to(device)
    group = dist.group.WORLD

    def with_mode(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            checks.set_check_mode(mode)
            try:
                return fn()
            finally:
                checks.set_check_mode(None)
        return run

    cases: dict[str, Callable[[], object]] = {
        "bare": lambda: bare_all_to_all(flat, group=group),
        "switch": lambda: dynamic_switch(x, 1, 2, global_len=frames),
        "switch [1,..]": lambda: dynamic_switch(x1, 1, 2, global_len=BATCH * frames),
        "switch always": with_mode("always", lambda: dynamic_switch(x, 1, 2, global_len=frames)),
        "switch off": with_mode("off", lambda: dynamic_switch(x, 1, 2, global_len=frames)),
        "fn(switch)": lambda: lin(dynamic_switch(x, 1, 2, global_len=frames)),
        "overlapped": lambda: switch_apply(x, lin, 1, 2, chunks=2, global_len=frames),
    }
    if old is not None:
        cases["old switch"] = lambda: old.dynamic_switch(x, 1, 2, global_len=frames)
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.no_grad():
        for fn in cases.values():   # warm-up, and the first-signature checks
            fn()
            fn()
        for rep in range(reps):
            names = list(cases)
            for name in names[rep % len(names):] + names[:rep % len(names)]:   # interleaved
                synchronize(device)
                start = time.perf_counter()
                cases[name]()
                synchronize(device)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()} | {"bytes": x.numel() * 4}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.switch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="group sizes (default 2 4)")
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 8], help="shard MiB per rank (default 4 8)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per case (default 20)")
    parser.add_argument("--compare-with", default=None, help="a module defining dynamic_switch to time beside this one "
                        "(a former dsp_plugin/comm.py, or dsp_plugin/comm/primitives.py)")
    args = parser.parse_args(argv)
    rows = []
    for n in args.nproc:
        for mib in args.mib:
            print(f"[switch] N={n}, {mib} MiB per rank, {args.reps} reps", file=sys.stderr, flush=True)
            per_rank = spawn(_worker, n, mib, args.reps, args.compare_with, timeout=1800, collective_timeout_s=300,
                             backend="auto")
            worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}     # the slowest rank sets the pace
            rows.append((n, mib, worst))
    names = [k for k in rows[0][2] if k not in ("bytes", "bare")]
    print("| N | shard MiB | bare a2a ms | " + " | ".join(f"{k} ms (x bare)" for k in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for n, mib, t in rows:
        cells = " | ".join(f"{1e3 * t[k]:.2f} ({t[k] / t['bare']:.2f}x)" for k in names)
        print(f"| {n} | {mib} | {1e3 * t['bare']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
