"""Issue 28's costs, side by side in one run: eager vs compiled, bf16 vs FP8 on the wire, our own Python.

    python -m dsp_plugin.bench.costs --nproc 2 [--quick]    # also: python -m dsp_plugin.bench [--costs-only]

On N gloo ranks (CPU), one table:

- **eager vs ``torch.compile``**: one training step (forward + backward) of a plan-parallelized tiny
  model (``dsp_plugin.parallelize``: the tiny Wan, head switch at diffusers' dispatch; and, unless
  ``--quick``, the reference STDiT, switches), eager and compiled with ``backend="aot_eager"`` (what
  ``tests/test_compile_models.py`` checks: every collective in one graph, outputs and gradients equal to
  eager's). aot_eager runs the captured graph with eager kernels, no code generation: on the CPU it shows
  what capturing the hooks and the model's Python into one graph saves, not a compiler's fused kernels.
  Timed in alternating order, round by round; the compile time of the first call is reported beside.
- **bf16 vs FP8 on the wire** (``comm_dtype="fp8"``, ``dsp_plugin.comm.payload``: e4m3 plus a float32
  scale per chunk): bytes sent per call by rank 0 (``CommAccounting``: the ``uint8`` buffer actually sent)
  and time per call, for ``dynamic_switch`` of a bf16 ``[B, T/N, S, D]`` shard and for the head switch
  (``to_heads`` of q, k, v packed, ``from_heads`` of the output) of bf16 ``[B, L/N, H, Dh]``.
  On the CPU the FP8 cast and scale cost more than the bytes they save over gloo's loopback; the bytes
  are what an interconnect-bound cluster pays.
- **the plan runtime's share of a step** (``dsp_plugin.bench.overhead``): the Wan of the bench's
  full-3D row (``dsp_plugin.bench.wan``), one forward and one training step; CPU time in the runtime's
  hooks plus the head switch's SDPA-level function mode (measured A/B) over the step's (the clock: it charges
  the hooks every cold cache line they touch). Beside it, what the runtime costs a forward (a denoising step):
  the plan's Wan against the same Wan made parallel by hand (``dsp_plugin.bench.hand_wan``, rank 0 of a fake
  world), the median of the rounds' paired differences with a 95% bootstrap interval.
- **the plan runtime under ``torch.compile``** (with the compile rows): at the same Wan, the Python calls
  into dsp_plugin per step (``sys.setprofile``), eager against ``backend="aot_eager"``, and the step's CPU
  time: compiled, the hooks run inside the graph and only the model's own hooks are left.

Times are medians over the rounds of the slowest rank's time per round; ratios are taken round by
round. Timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["markdown", "run"]

#: shard per rank of the switch rows: [B, T/N, S, D] bf16 = 2 x 4 x 256 x 1024 x 2 B = 4 MiB (quick: 1 MiB)
SWITCH = (2, 4, 256, 1024)
SWITCH_QUICK = (2, 2, 128, 1024)
#: q, k, v per rank of the head-switch rows: [B, L/N, H, Dh] bf16 = 1 x 2048 x 16 x 64 x 2 B = 4 MiB each
HEADS = (1, 2048, 16, 64)
HEADS_QUICK = (1, 512, 16, 64)


def _compile_model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """The models and inputs of ``tests/test_compile_models.py`` (``testing.tiny.compile_case``)."""
    from dsp_plugin.testing.tiny import compile_case

    return compile_case(name)


def _compile_worker(rank: int, n: int, names: tuple[str, ...], rounds: int) -> dict[str, Any]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()
    from torch._dynamo.utils import counters

    import dsp_plugin
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())
    out: dict[str, Any] = {}
    for name in names:
        base, args, kwargs = _compile_model(name)
        models = {"eager": dsp_plugin.parallelize(copy.deepcopy(base)),
                  "compiled": dsp_plugin.parallelize(copy.deepcopy(base))}

        def step(model: Any) -> None:
            x = args[0].clone().requires_grad_(True)
            y = model(x, *args[1:], **kwargs)
            (y[0] if isinstance(y, tuple) else y).square().mean().backward()
            for p in model.parameters():
                p.grad = None

        for model in models.values():
            step(model)          # eager first: the first call's cross-rank checks (as the compile tests do)
        models["compiled"] = torch.compile(models["compiled"], backend="aot_eager")
        start = time.perf_counter()
        step(models["compiled"])  # compiles
        compile_s = time.perf_counter() - start
        graphs = counters["stats"]["unique_graphs"]
        step(models["compiled"])
        if counters["stats"]["unique_graphs"] > graphs:  # compiled again at the second call: a guard that fails
            # at every step; timing it would time the compiler (tens of seconds a step), so it is reported instead
            out[name] = {"times": None, "compile_s": compile_s,
                         "recompiled": counters["stats"]["unique_graphs"] - graphs}
            torch._dynamo.reset()
            continue
        times: dict[str, list[float]] = {k: [] for k in models}
        for r in range(rounds):
            for kind in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                start = time.perf_counter()
                step(models[kind])
                times[kind].append(time.perf_counter() - start)
        # graphs compiled during the timed rounds (0 unless a guard fails now and then)
        out[name] = {"times": times, "compile_s": compile_s, "recompiled": counters["stats"]["unique_graphs"] - graphs}
        torch._dynamo.reset()
    return out


def _calls_into_dsp_plugin(fn: Any) -> int:
    """Python calls into dsp_plugin's code while ``fn()`` runs (``sys.setprofile``; the bench's own code left out)."""
    calls = [0]
    ours, bench = f"{os.sep}dsp_plugin{os.sep}", f"{os.sep}dsp_plugin{os.sep}bench{os.sep}"

    def profile(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and ours in name and bench not in name:
            calls[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def _compiled_runtime_worker(rank: int, n: int, size: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """The bench's Wan parallelized, eager and ``torch.compile``d (aot_eager): per step, the Python calls into
    dsp_plugin and the step's CPU time on this thread, alternating."""
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()
    import dsp_plugin
    from dsp_plugin.bench.overhead import wan_step
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())
    reference, batch = _setup(size)
    eager = dsp_plugin.parallelize(copy.deepcopy(reference))
    models = {"eager": eager, "compiled": torch.compile(eager, backend="aot_eager")}

    def step(model: Any, mode: str) -> None:
        wan_step(model, batch, mode)
        eager.zero_grad(set_to_none=True)

    out: dict[str, Any] = {}
    for mode in ("forward", "train"):
        for kind in ("eager", "compiled", "compiled"):   # the first eager call checks; the compiled ones compile
            step(models[kind], mode)
        calls = {kind: _calls_into_dsp_plugin(lambda m=m: step(m, mode)) for kind, m in models.items()}
        cpu: dict[str, list[float]] = {k: [] for k in models}
        for r in range(rounds):
            for kind in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                start = time.thread_time()
                step(models[kind], mode)
                cpu[kind].append(time.thread_time() - start)
        out[mode] = {"calls": calls, "cpu": cpu}
    torch._dynamo.reset()
    return out


def _switch_worker(rank: int, n: int, switch: tuple[int, ...], heads: tuple[int, ...], reps: int) -> dict[str, Any]:
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
    cases = {}
    for wire in ("bf16", "fp8"):
        dtype = None if wire == "bf16" else "fp8"
        cases[("dynamic_switch", wire)] = lambda dtype=dtype: dynamic_switch(x, 1, 2, global_len=t_local * n,
                                                                               comm_dtype=dtype)
        cases[("to_heads", wire)] = lambda dtype=dtype: to_heads(q, k, v, seq_dim=1, head_dim=2,
                                                                  global_len=l_local * n, comm_dtype=dtype)
        cases[("from_heads", wire)] = lambda dtype=dtype: from_heads(o, seq_dim=1, head_dim=2,
                                                                      global_len=l_local * n, heads=h,
                                                                      comm_dtype=dtype)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for key, fn in cases.items():
            fn()                                   # warm-up and the first call's checks
            with CommAccounting(activations=False) as acct:
                fn()
            out[f"{key[0]}/{key[1]}"] = {"bytes": acct.bytes_sent("all_to_all"), "count": acct.count("all_to_all"),
                                         "times": []}
        keys = list(cases)
        for r in range(reps):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:   # interleaved
                start = time.perf_counter()
                cases[key]()
                out[f"{key[0]}/{key[1]}"]["times"].append(time.perf_counter() - start)
    return out


def _per_round_max(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank)]


def run(n: int = 2, *, quick: bool = False, rounds: int | None = None, models: tuple[str, ...] | None = None,
        switch: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None,
        runtime_size: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The costs as one dict (``markdown`` prints it). ``models``: the compiled ones (``"wan"``,
    ``"stdit"``; ``()`` leaves the compile rows out); ``switch``/``heads``: the per-rank shapes of the wire
    rows; ``runtime_size``: the Wan of the runtime's share (``bench.wan``'s size tuple)."""
    from dsp_plugin.bench import hand_wan, overhead, wan

    rounds = rounds or (10 if quick else 20)
    names = models if models is not None else (("wan",) if quick else ("wan", "stdit"))
    result: dict[str, Any] = {"n": n, "quick": quick, "rounds": rounds, "compile": {}, "wire": {}}
    if names:
        print(f"[costs] eager vs compiled (aot_eager): {', '.join(names)} on {n} ranks", file=sys.stderr, flush=True)
        per_rank = spawn(_compile_worker, n, names, rounds, timeout=1200, collective_timeout_s=300)
    for name in names:
        if any(r[name]["times"] is None for r in per_rank):
            result["compile"][name] = {"recompiles_every_call": True,
                                       "compile_s": max(r[name]["compile_s"] for r in per_rank),
                                       "recompiled": max(r[name]["recompiled"] for r in per_rank)}
            continue
        eager = _per_round_max([r[name]["times"]["eager"] for r in per_rank])
        compiled = _per_round_max([r[name]["times"]["compiled"] for r in per_rank])
        result["compile"][name] = {"eager_s": statistics.median(eager), "compiled_s": statistics.median(compiled),
                                   "ratio": statistics.median(c / e for c, e in zip(compiled, eager)),
                                   "compile_s": max(r[name]["compile_s"] for r in per_rank),
                                   "recompiled": max(r[name]["recompiled"] for r in per_rank)}
    switch = switch or (SWITCH_QUICK if quick else SWITCH)
    heads = heads or (HEADS_QUICK if quick else HEADS)
    print(f"[costs] bf16 vs fp8 on the wire: dynamic_switch {switch}, head switch {heads} per rank",
          file=sys.stderr, flush=True)
    per_rank = spawn(_switch_worker, n, switch, heads, rounds * 3, timeout=900, collective_timeout_s=300)
    result["wire"] = {"switch_shape": switch, "heads_shape": heads}
    for op in ("dynamic_switch", "to_heads", "from_heads"):
        bf16 = _per_round_max([r[f"{op}/bf16"]["times"] for r in per_rank])
        fp8 = _per_round_max([r[f"{op}/fp8"]["times"] for r in per_rank])
        result["wire"][op] = {"bf16_bytes": per_rank[0][f"{op}/bf16"]["bytes"],
                              "fp8_bytes": per_rank[0][f"{op}/fp8"]["bytes"],
                              "all_to_alls": per_rank[0][f"{op}/fp8"]["count"],
                              "bf16_s": statistics.median(bf16), "fp8_s": statistics.median(fp8),
                              "time_ratio": statistics.median(f / b for f, b in zip(fp8, bf16))}
    size = runtime_size or (wan.QUICK if quick else wan.SIZE)
    print(f"[costs] the plan runtime's share: Wan {size} on {n} ranks", file=sys.stderr, flush=True)
    result["runtime"] = overhead.rows(overhead.measure(n, size, rounds=rounds))
    print(f"[costs] the plan runtime's cost against the hand-written Wan: Wan {size}, {rounds * 10} paired rounds",
          file=sys.stderr, flush=True)
    result["runtime_cost"] = hand_wan.measure_against_hand(n, size, rounds=rounds * 10, per_round=2)
    result["compiled_runtime"] = {}
    if names:   # with the compile rows: the runtime's Python left under torch.compile, at the same Wan
        print(f"[costs] the plan runtime under torch.compile: Wan {size} on {n} ranks", file=sys.stderr, flush=True)
        per_rank = spawn(_compiled_runtime_worker, n, size, rounds, timeout=1200, collective_timeout_s=300)
        for mode in ("forward", "train"):
            cpu = {k: _per_round_max([r[mode]["cpu"][k] for r in per_rank]) for k in ("eager", "compiled")}
            result["compiled_runtime"][mode] = {
                "size": size, "calls": {k: max(r[mode]["calls"][k] for r in per_rank) for k in ("eager", "compiled")},
                "eager_cpu_s": statistics.median(cpu["eager"]), "compiled_cpu_s": statistics.median(cpu["compiled"])}
    return result


def markdown(result: dict[str, Any]) -> str:
    n = result["n"]
    lines = [f"N={n} gloo ranks, CPU; medians over {result['rounds']} rounds of the slowest rank's time "
             "(ratios round by round).", "",
             "| cost | A | B | B / A | notes |", "| --- | --- | --- | --- | --- |"]
    labels = {"wan": "tiny Wan (2 layers, 3 heads, 5 frames 6x6, batch 2)",
              "stdit": "reference STDiT (tiny preset, 5 frames 6x6, batch 2)"}
    for name, r in result["compile"].items():
        if r.get("recompiles_every_call"):
            lines.append(f"| step (forward + backward), {labels[name]}: eager (A) vs torch.compile aot_eager (B) | - | "
                         f"- | - | NOT TIMED: compiled again at the second call (new graphs: {r['recompiled']}): "
                         f"a guard fails at every step; first compiled call {r['compile_s']:.0f} s |")
            continue
        lines.append(f"| step (forward + backward), {labels[name]}: eager (A) vs torch.compile aot_eager (B) | "
                     f"{1e3 * r['eager_s']:.1f} ms | {1e3 * r['compiled_s']:.1f} ms | {r['ratio']:.2f} | "
                     f"first compiled call {r['compile_s']:.0f} s; graphs compiled again in the timed rounds: "
                     f"{r['recompiled']} |")
    wire = result["wire"]
    shapes = {"dynamic_switch": f"[B, T/N, S, D] = {list(wire['switch_shape'])} bf16, S(T) -> S(S)",
              "to_heads": f"q, k, v [B, L/N, H, Dh] = {list(wire['heads_shape'])} bf16 each, packed",
              "from_heads": "the output back, [B, L, H/N, Dh] bf16"}
    for op in ("dynamic_switch", "to_heads", "from_heads"):
        r = wire[op]
        lines.append(f"| {op}: bf16 (A) vs FP8 (B) on the wire, {shapes[op]} | {r['bf16_bytes']:,} B, "
                     f"{1e3 * r['bf16_s']:.2f} ms | {r['fp8_bytes']:,} B, {1e3 * r['fp8_s']:.2f} ms | "
                     f"bytes {r['fp8_bytes'] / r['bf16_bytes']:.3f}, time {r['time_ratio']:.2f} | "
                     f"bytes sent by rank 0 per call ({r['all_to_alls']} all-to-all) |")
    for r in result["runtime"]:
        layers, heads, head_dim = r["size"][:3]
        what = "forward (a denoising step)" if r["mode"] == "forward" else "forward + backward"
        step_cpu = r["plan_cpu_ms"] / r["cpu_share"] if r["cpu_share"] else float("nan")
        lines.append(f"| plan runtime's share of a Wan {what} ({layers} layers, {heads} x {head_dim}, "
                     f"{r['tokens']} tokens): step CPU (A) vs the runtime's CPU (B) | {step_cpu:.1f} ms | "
                     f"{r['plan_cpu_ms'] + r['mode_cpu_ms']:.2f} ms | {100 * r['total_share']:.1f}% | hooks "
                     f"{100 * r['cpu_share']:.1f}% + SDPA-level mode {100 * r['mode_share']:.1f}% ({r['mode_calls']} "
                     f"ops); hooks' wall share {100 * r['share']:.1f}% |")
    r = result.get("runtime_cost")
    if r is not None:
        layers, heads, head_dim = r["size"][:3]
        low, high = r["paired_interval"]
        lines.append(f"| plan runtime's cost of a Wan forward (a denoising step; {layers} layers, {heads} x "
                     f"{head_dim}): made parallel by hand (A) vs by the plan (B), rank 0 of a fake world of {r['n']} | "
                     f"{r['hand_ms']:.1f} ms | {r['plan_ms']:.1f} ms | {100 * r['paired_share']:.1f}% "
                     f"[{100 * low:.1f}, {100 * high:.1f}] | CPU ms per forward, medians; the share: the median of "
                     f"{r['rounds']} rounds' paired differences (B - A) over B's median, with a 95% bootstrap "
                     f"interval |")
    for mode, r in result.get("compiled_runtime", {}).items():
        layers, heads, head_dim = r["size"][:3]
        what = "forward (a denoising step)" if mode == "forward" else "forward + backward"
        lines.append(f"| plan runtime's Python per Wan {what} ({layers} layers, {heads} x {head_dim}): eager (A) vs "
                     f"torch.compile aot_eager (B) | {r['calls']['eager']} calls, step CPU "
                     f"{1e3 * r['eager_cpu_s']:.1f} ms | {r['calls']['compiled']} calls, step CPU "
                     f"{1e3 * r['compiled_cpu_s']:.1f} ms | calls {r['calls']['compiled'] / r['calls']['eager']:.3f} | "
                     "Python calls into dsp_plugin per step (sys.setprofile, the slowest rank's); compiled, the "
                     "hooks run inside the graph |")
    return "\n".join(lines)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    stem = out / f"costs_n{result['n']}"
    stem.with_suffix(".md").write_text(markdown(result) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return [stem.with_suffix(".md"), stem.with_suffix(".json")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.costs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--quick", action="store_true", help="tiny Wan only, small shards, 10 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20, quick 10)")
    parser.add_argument("--out", type=Path, default=None, help="also write costs_n{N}.md and .json there")
    args = parser.parse_args(argv)
    result = run(args.nproc, quick=args.quick, rounds=args.rounds)
    print(markdown(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
