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

``wire`` (a part of ``python -m dsp_plugin.bench --costs``): bf16 against FP8 on the wire (``comm_dtype="fp8"``,
``comm.payload``: e4m3 plus a float32 scale per chunk), bytes sent by rank 0 per call (``CommAccounting``: the
``uint8`` buffer sent) and time per call, for ``dynamic_switch`` of a bf16 ``[B, T/N, S, D]`` shard and the head
switch (``to_heads`` of q, k, v packed, ``from_heads`` of the output) of bf16 ``[B, L/N, H, Dh]``. On the CPU the
cast and scale cost more than the bytes they save over gloo's loopback; the bytes are what a slow link pays.

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
#: per rank, the wire rows' switch shard [B, T/N, S, D] (bf16: 4 MiB, quick 1 MiB) and q, k, v [B, L/N, H, Dh]
WIRE, WIRE_QUICK = (2, 4, 256, 1024), (2, 2, 128, 1024)
HEADS, HEADS_QUICK = (1, 2048, 16, 64), (1, 512, 16, 64)


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


def _wire_worker(rank: int, n: int, switch: tuple[int, ...], heads: tuple[int, ...], reps: int) -> dict[str, Any]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import dynamic_switch
    from dsp_plugin.head_switch import from_heads, to_heads
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())
    g = torch.Generator().manual_seed(rank)
    b, t_local, s, d = switch
    x = torch.randn(b, t_local, s, d, generator=g).to(torch.bfloat16)
    hb, l_local, h, dh = heads
    q, k, v = (torch.randn(hb, l_local, h, dh, generator=g).to(torch.bfloat16) for _ in range(3))
    o = torch.randn(hb, l_local * n, h // n, dh, generator=g).to(torch.bfloat16)
    cases: dict[str, Callable[[], object]] = {}
    for wire, dtype in (("bf16", None), ("fp8", "fp8")):
        cases[f"dynamic_switch/{wire}"] = lambda dtype=dtype: dynamic_switch(x, 1, 2, global_len=t_local * n,
                                                                            comm_dtype=dtype)
        cases[f"to_heads/{wire}"] = lambda dtype=dtype: to_heads(q, k, v, seq_dim=1, head_dim=2,
                                                               global_len=l_local * n, comm_dtype=dtype)
        cases[f"from_heads/{wire}"] = lambda dtype=dtype: from_heads(o, seq_dim=1, head_dim=2, global_len=l_local * n,
                                                                   heads=h, comm_dtype=dtype)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for key, fn in cases.items():
            fn()                                   # warm-up and the first call's checks
            with CommAccounting(activations=False) as acct:
                fn()
            out[key] = {"bytes": acct.bytes_sent("all_to_all"), "count": acct.count("all_to_all"), "times": []}
        keys = list(cases)
        for r in range(reps):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:   # interleaved
                start = time.perf_counter()
                cases[key]()
                out[key]["times"].append(time.perf_counter() - start)
    return out


def wire(n: int, switch: tuple[int, ...], heads: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Per op (``dynamic_switch``, ``to_heads``, ``from_heads``): rank 0's bytes per call and all-to-alls, bf16 and
    FP8, the medians of the slowest rank's time per call, and the FP8/bf16 time ratio taken call by call."""
    per_rank = spawn(_wire_worker, n, switch, heads, reps, timeout=900, collective_timeout_s=300)
    out: dict[str, Any] = {"switch_shape": switch, "heads_shape": heads}
    for op in ("dynamic_switch", "to_heads", "from_heads"):
        bf16, fp8 = ([max(ts) for ts in zip(*(r[f"{op}/{w}"]["times"] for r in per_rank))] for w in ("bf16", "fp8"))
        out[op] = {"bf16_bytes": per_rank[0][f"{op}/bf16"]["bytes"], "fp8_bytes": per_rank[0][f"{op}/fp8"]["bytes"],
                   "all_to_alls": per_rank[0][f"{op}/fp8"]["count"], "bf16_s": statistics.median(bf16),
                   "fp8_s": statistics.median(fp8), "time_ratio": statistics.median(f / b for f, b in zip(fp8, bf16))}
    return out


def wire_rows(result: dict[str, Any]) -> list[str]:
    """``wire``'s rows in the costs table (``| cost | A | B | B / A | notes |``)."""
    shapes = {"dynamic_switch": f"[B, T/N, S, D] = {list(result['switch_shape'])} bf16, S(T) -> S(S)",
              "to_heads": f"q, k, v [B, L/N, H, Dh] = {list(result['heads_shape'])} bf16 each, packed",
              "from_heads": "the output back, [B, L, H/N, Dh] bf16"}
    return [f"| {op}: bf16 (A) vs FP8 (B) on the wire, {shapes[op]} | {r['bf16_bytes']:,} B, {1e3 * r['bf16_s']:.2f} "
            f"ms | {r['fp8_bytes']:,} B, {1e3 * r['fp8_s']:.2f} ms | bytes {r['fp8_bytes'] / r['bf16_bytes']:.3f}, "
            f"time {r['time_ratio']:.2f} | bytes sent by rank 0 per call ({r['all_to_alls']} all-to-all) |"
            for op, r in ((op, result[op]) for op in shapes)]


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
