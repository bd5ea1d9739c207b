"""What the plan runtime costs a step, three ways, beside bf16 against FP8 on the wire.

    python -m dsp_plugin.bench --costs --nproc 2 [--quick] [--steps 20] [--size L,H,D,F,HW]
    python -m dsp_plugin.bench --costs --device cuda:0    # only the A/B, on a GPU (wall time)

At the bench's Wan (``bench.wan``): **the A/B** (``measure_against_hand``), the plan's Wan against the same Wan made
parallel by hand (``bench.wan.hand_parallel``), alternating rounds: the median of the rounds' *paired* differences
(a machine's drift cancels in a pair) over the plan's median step, with a seeded 95% bootstrap interval, on rank 0
of a fake world (torch's ``fake`` process group: a rank's Python, collectives that move no data) or gloo ranks.
**The clock** (``clock_share``, gloo ranks): exclusive CPU time in the plan's hooks, dispatch wrapper, ``attend``
and autograd backward, less the collectives and the kernel inside them, over the step's; the clock's own reads
measured where they run (probe steps) and taken off. It charges the hooks every cold cache line they touch after
a kernel, part of which the model's own Python would pay: it reads above the A/B. **Compiled**: Python calls into
dsp_plugin per step, eager and ``torch.compile``d (aot_eager). **The wire** (``bench.switch.wire``): bf16 vs FP8.
Times are medians over the rounds of the slowest rank's. Timing is printed, never asserted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dsp_plugin.bench import switch as wire
from dsp_plugin.bench.wan import QUICK, SIZE, _setup, hand_parallel, wan_step
from dsp_plugin.spawn import spawn

__all__ = ["ab_markdown", "clock_share", "markdown", "measure_against_hand", "median_interval", "run", "write"]

MODES = ("forward", "train")
STEPS = {"forward": "forward (a denoising step)", "train": "forward + backward"}


def _rank_setup() -> None:
    from dsp_plugin.log import quiet_third_party
    from dsp_plugin.topology import Topology, set_topology

    quiet_third_party()
    set_topology(Topology.world())


def measure_against_hand(n: int = 2, size: tuple[int, ...] | None = None, *, rounds: int = 40,
                         per_round: int = 5, device: str = "cpu", backward: bool = False, world: str = "fake",
                         control: bool = False) -> dict[str, Any]:
    """ms per step of the plan's Wan and the hand-written one over ``rounds`` alternating rounds of ``per_round``
    steps: minima, medians and the paired estimate, each as a share of the plan's median step. ``world="fake"``:
    rank 0 of a fake world of ``n`` here, one CPU thread; ``"gloo"``: ``n`` gloo ranks, a round's time its slowest
    rank's. ``device="cuda:0"``: wall ms, the device synchronized at each round's ends. ``backward``: a training
    step (the output's mean square). ``control``: the plan's Wan against a second copy of itself (A/A)."""
    size = tuple(size or SIZE)
    where = torch.device(device)
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"measure_against_hand: device={device!r}; expected 'cpu' or a CUDA device on a machine "
                         f"with one (CUDA available: {torch.cuda.is_available()})")
    if world not in ("fake", "gloo") or (world == "gloo" and where.type != "cpu"):
        raise ValueError(f"measure_against_hand: world={world!r} on device={device!r}; expected 'fake', or 'gloo' "
                         f"on the CPU")
    if world == "gloo":
        per_rank = spawn(_rank_rounds, n, size, rounds, per_round, backward, control, timeout=3600,
                         collective_timeout_s=300)
        plan_s, hand_s = ([max(times) for times in zip(*[r[i] for r in per_rank])] for i in (0, 1))
    else:
        from dsp_plugin.fake_world import fake_world

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with fake_world(n, dsp=n):
                plan_s, hand_s = _rounds(None, size, rounds, per_round, where, backward, control)
        finally:
            torch.set_num_threads(threads)
    p, h, p_min, h_min = statistics.median(plan_s), statistics.median(hand_s), min(plan_s), min(hand_s)
    paired = [a - b for a, b in zip(plan_s, hand_s)]
    low, high = median_interval(paired)
    return {"n": n, "size": size, "rounds": rounds, "device": device, "backward": backward, "world": world,
            "control": control, "plan_ms": 1e3 * p, "hand_ms": 1e3 * h,
            "diff_ms": 1e3 * (p - h), "share": (p - h) / p, "plan_min_ms": 1e3 * p_min, "hand_min_ms": 1e3 * h_min,
            "diff_min_ms": 1e3 * (p_min - h_min), "share_min": (p_min - h_min) / p_min,
            "paired_ms": 1e3 * statistics.median(paired), "paired_share": statistics.median(paired) / p,
            "paired_interval": (low / p, high / p)}


def median_interval(values: list[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (seeded: a table is reproducible from its times)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _rank_rounds(rank: int, n: int, size: tuple[int, ...], rounds: int, per_round: int, backward: bool,
                 control: bool) -> tuple[list[float], list[float]]:
    _rank_setup()
    torch.set_num_threads(1)
    return _rounds(torch.distributed.group.WORLD, size, rounds, per_round, torch.device("cpu"), backward, control)


def _rounds(group: Any, size: tuple[int, ...], rounds: int, per_round: int, where: torch.device, backward: bool,
            control: bool) -> tuple[list[float], list[float]]:
    """Seconds per step of the plan's Wan and of the other (by hand, or a second plan copy), round by round."""
    import dsp_plugin

    reference, batch = _setup(size)
    reference, batch = reference.to(where), tuple(t.to(where) for t in batch)
    plan = dsp_plugin.parallelize(copy.deepcopy(reference), group=group)
    if control:
        other, running = dsp_plugin.parallelize(copy.deepcopy(reference), group=group), contextlib.nullcontext
    else:
        other, running = hand_parallel(reference, size, group=group)
    clock = time.thread_time if where.type == "cpu" else time.perf_counter

    def step(model: Any) -> float:
        context = running() if model is other else contextlib.nullcontext()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        start = clock()
        with torch.set_grad_enabled(backward), context:
            for _ in range(per_round):
                out = model(*batch, return_dict=False)[0]
                if backward:
                    out.float().square().mean().backward()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        return (clock() - start) / per_round

    for _ in range(2):  # warm-up: the plan's first calls learn how each module attends
        step(plan), step(other)
    times: dict[Any, list[float]] = {plan: [], other: []}
    for r in range(rounds):  # alternating which goes first
        for model in (plan, other) if r % 2 == 0 else (other, plan):
            times[model].append(step(model))
    return times[plan], times[other]


def ab_markdown(result: dict[str, Any]) -> str:
    r = result
    layers, heads, head_dim, frames, hw = r["size"]
    step = "forward + backward" if r.get("backward") else "forward"
    clock = "CPU" if r.get("device", "cpu") == "cpu" else f"wall ({r['device']})"
    other = "a second plan copy (A/A)" if r.get("control") else "by hand"
    low, high = r["paired_interval"]
    return (f"| Wan (layers, heads x dim, tokens) | N ({r.get('world', 'fake')}), rounds | {step} {clock} ms, plan: "
            f"min (median) | {other}: min (median) | plan - other: minima (medians) | paired, ms: the rounds' "
            "differences' median | **the runtime's share**: paired [95% interval] (minima, medians) |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| {layers}, {heads} x {head_dim}, {frames * (hw // 2) ** 2} | {r['n']}, {r['rounds']} | "
            f"{r['plan_min_ms']:.2f} ({r['plan_ms']:.2f}) | {r['hand_min_ms']:.2f} ({r['hand_ms']:.2f}) | "
            f"{r['diff_min_ms']:.3f} ({r['diff_ms']:.3f}) | {r['paired_ms']:.3f} | **{100 * r['paired_share']:.1f}%** "
            f"[{100 * low:.1f}, {100 * high:.1f}] ({100 * r['share_min']:.1f}%, {100 * r['share']:.1f}%) |")


class _Clock:
    """Exclusive CPU time of this thread per category (``plan``, ``excluded``) over nested timed calls. Off, with
    ``probe`` set (a probe step), a ``plan`` call runs ``probe[0]`` first and an ``excluded`` one ``probe[1]`` after:
    timed no-ops on two other clocks, what this clock's reads cost at those places (cold, after a kernel)."""

    def __init__(self) -> None:
        self.on, self.probe, self.stack, self.last = False, None, [], 0.0
        self.reset()

    def reset(self) -> None:
        self.cpu, self.calls = {"plan": 0.0, "excluded": 0.0}, {"plan": 0, "excluded": 0, "mode": 0}

    def timed(self, category: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                if self.probe is None:
                    return fn(*args, **kwargs)
                if category == "plan":
                    self.probe[0]()
                    return fn(*args, **kwargs)
                out = fn(*args, **kwargs)
                self.probe[1]()
                return out
            now = time.thread_time()
            if self.stack:
                self.cpu[self.stack[-1]] += now - self.last
            self.stack.append(category)
            self.calls[category] += 1
            self.last = now
            try:
                return fn(*args, **kwargs)
            finally:
                now = time.thread_time()
                self.cpu[self.stack.pop()] += now - self.last
                self.last = now

        return call


def _instrument(clock: _Clock, model: Any) -> None:
    """Patch this rank: every hook ``parallelize`` made on ``model`` (registered with torch, or its wrappers' pre,
    post and bypass), the dispatch wrapper, ``attend`` and the plan's autograd backward timed as the plan's; the
    collectives and the attention kernel excluded; the ops through the head switch's SDPA-level mode counted."""
    import dsp_plugin
    from dsp_plugin import every_gradient
    from dsp_plugin.head_switch import exchange
    from dsp_plugin.plan import attention, dispatch, ops
    from dsp_plugin.plan.wrap import wrappers

    for module, name in ((ops, "dynamic_switch"), (ops, "gather"), (exchange, "_to_heads"), (exchange, "from_heads")):
        setattr(module, name, clock.timed("excluded", getattr(module, name)))
    attention.HeadsCall.attend = clock.timed("plan", attention.HeadsCall.attend)
    wrap = dispatch._wrap_backend

    def wrap_backend(name: Any, fn: Any) -> Any:  # the original kernel excluded, the wrapper timed
        inner = clock.timed("excluded", fn)
        outer = clock.timed("plan", wrap(name, inner))
        outer._dsp_heads_original = inner  # type: ignore[attr-defined]
        return outer

    dispatch._wrap_backend = wrap_backend
    for cls in (ops._ScaleGrad, every_gradient._Touch):
        cls.backward = staticmethod(clock.timed("plan", cls.backward))
    through_mode = attention._HeadSwitchMode.__torch_function__

    def counted(*args: Any, **kwargs: Any) -> Any:
        clock.calls["mode"] += clock.on
        return through_mode(*args, **kwargs)

    attention._HeadSwitchMode.__torch_function__ = counted
    hooks = lambda: [d for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)]  # noqa: E731
    before = {id(d): set(d) for d in hooks()}
    dsp_plugin.parallelize(model)
    for d in hooks():
        for key in set(d) - before.get(id(d), set()):
            d[key] = clock.timed("plan", d[key])
    for wrapper in wrappers(model):
        for side in ("pre", "post", "bypass"):
            if getattr(wrapper, side) is not None:
                setattr(wrapper, side, clock.timed("plan", getattr(wrapper, side)))


def _clock_worker(rank: int, n: int, size: tuple[int, ...], rounds: int) -> dict[str, Any]:
    _rank_setup()
    clock, probes = _Clock(), (_Clock(), _Clock())
    model, batch = _setup(size)
    _instrument(clock, model)
    probe_calls = tuple(p.timed("plan", lambda: None) for p in probes)
    out: dict[str, Any] = {}
    for mode in MODES:
        for _ in range(2):  # warm-up: the first call's cross-rank checks, every_gradient's learning forward
            wan_step(model, batch, mode)
        rows: dict[str, list[Any]] = {k: [] for k in ("step", "untimed", "raw", "calls", "excluded", "mode", "own")}
        kinds = ["timed", "untimed", "probe"]
        for r in range(rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:   # rotating order
                model.zero_grad(set_to_none=True)
                for c in (clock, *probes):
                    c.reset()
                    c.on = c is not clock or kind == "timed"
                clock.probe = probe_calls if kind == "probe" else None
                start = time.thread_time()
                wan_step(model, batch, mode)
                cpu = time.thread_time() - start
                clock.on, clock.probe = False, None
                if kind == "timed":
                    for key, value in (("step", cpu), ("raw", clock.cpu["plan"]), ("calls", clock.calls["plan"]),
                                       ("excluded", clock.calls["excluded"]), ("mode", clock.calls["mode"])):
                        rows[key].append(value)
                elif kind == "untimed":
                    rows["untimed"].append(cpu)
                else:
                    rows["own"].append([p.cpu["plan"] / max(p.calls["plan"], 1) for p in probes])
        # the clock's reads, charged to the plan, taken off at what they cost where they ran (the probes' median)
        own = [statistics.median(o[i] for o in rows["own"]) for i in (0, 1)]
        rows["plan"] = [raw - c * own[0] - e * own[1] for raw, c, e in zip(rows["raw"], rows["calls"],
                                                                             rows["excluded"])]
        out[mode] = rows | {"own": own}
    return out


def clock_share(n: int = 2, size: tuple[int, ...] | None = None, *, rounds: int = 20) -> list[dict[str, Any]]:
    """The clock's rows, a forward's and a training step's: medians over the rounds of the slowest rank's step and
    runtime CPU ms and of the largest rank's share; the clock's reads taken off, us a call (the largest rank's)."""
    size = tuple(size or SIZE)
    per_rank = spawn(_clock_worker, n, size, rounds, timeout=900, collective_timeout_s=120)
    out = []
    for mode in MODES:
        ranks = [r[mode] for r in per_rank]

        def slowest(key: str) -> float:
            return 1e3 * statistics.median(max(v) for v in zip(*(r[key] for r in ranks)))

        shares = [max(p / s for p, s in zip(ps, ss)) for ps, ss in zip(zip(*(r["plan"] for r in ranks)),
                                                                         zip(*(r["step"] for r in ranks)))]
        out.append({"mode": mode, "n": n, "size": size, "tokens": size[3] * (size[4] // 2) ** 2,
                    "step_ms": slowest("step"), "untimed_ms": slowest("untimed"), "plan_cpu_ms": slowest("plan"),
                    "plan_raw_cpu_ms": slowest("raw"), "share": statistics.median(shares),
                    "calls": ranks[0]["calls"][0], "mode_calls": ranks[0]["mode"][0],
                    "clock_us": {k: 1e6 * max(r["own"][i] for r in ranks)
                                 for i, k in enumerate(("plan_cpu", "excluded_cpu"))}})
    return out


def _compiled_runtime_worker(rank: int, n: int, size: tuple[int, ...]) -> dict[str, Any]:
    """The bench's Wan parallelized, eager and ``torch.compile``d (aot_eager): the Python calls into dsp_plugin's code
    in one step of each (``sys.setprofile``; the bench's own code left out)."""
    import dsp_plugin

    _rank_setup()
    reference, batch = _setup(size)
    eager = dsp_plugin.parallelize(copy.deepcopy(reference))
    models = {"eager": eager, "compiled": torch.compile(eager, backend="aot_eager")}
    ours, bench = f"{os.sep}dsp_plugin{os.sep}", f"{os.sep}dsp_plugin{os.sep}bench{os.sep}"
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        calls[0] += event == "call" and ours in frame.f_code.co_filename and bench not in frame.f_code.co_filename

    out: dict[str, Any] = {}
    for mode in MODES:
        out[mode] = {"calls": {}}
        for i, kind in enumerate(("eager", "compiled", "compiled", "eager", "compiled")):  # check, compile, count
            calls[0] = 0
            sys.setprofile(profile if i > 2 else None)
            try:
                wan_step(models[kind], batch, mode)
            finally:
                sys.setprofile(None)
            eager.zero_grad(set_to_none=True)
            out[mode]["calls"][kind] = calls[0]
    torch._dynamo.reset()
    return out


def run(n: int = 2, *, quick: bool = False, rounds: int | None = None, size: tuple[int, ...] | None = None,
        compiled: bool = True, switch: tuple[int, ...] | None = None,
        heads: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The costs as one dict (``markdown`` prints it): the wire (``switch``/``heads``: per-rank shapes), the clock,
    the A/B (10 paired rounds of 2 forwards per clock round) and, with ``compiled``, the compiled calls."""
    rounds = rounds or (10 if quick else 20)
    size = tuple(size or (QUICK if quick else SIZE))
    switch = switch or (wire.WIRE_QUICK if quick else wire.WIRE)
    heads = heads or (wire.HEADS_QUICK if quick else wire.HEADS)

    def log(what: str) -> None:
        print(f"[costs] {what}", file=sys.stderr, flush=True)

    log(f"bf16 vs fp8 on the wire: dynamic_switch {switch}, head switch {heads} per rank, {n} ranks")
    result: dict[str, Any] = {"n": n, "rounds": rounds, "size": size, "wire": wire.wire(n, switch, heads, rounds * 3)}
    log(f"the clock: the plan runtime's share of a Wan {size} step, {n} ranks")
    result["runtime"] = clock_share(n, size, rounds=rounds)
    log(f"the plan runtime's cost against the hand-written Wan {size}: {rounds * 10} paired rounds, rank 0 of a "
        f"fake world of {n}")
    result["runtime_cost"] = measure_against_hand(n, size, rounds=rounds * 10, per_round=2)
    result["compiled_runtime"] = {}
    if compiled:
        log(f"the plan runtime under torch.compile (aot_eager): Wan {size}, {n} ranks")
        per_rank = spawn(_compiled_runtime_worker, n, size, timeout=1200, collective_timeout_s=300)
        result["compiled_runtime"] = {m: {k: max(r[m]["calls"][k] for r in per_rank) for k in ("eager", "compiled")}
                                      for m in MODES}
    return result


def markdown(result: dict[str, Any]) -> str:
    layers, heads, head_dim = result["size"][:3]
    wan = f"{layers} layers, {heads} x {head_dim}"
    lines = [f"N={result['n']} gloo ranks, CPU; medians over {result['rounds']} rounds of the slowest rank's time "
             "(ratios round by round).", "", "| cost | A | B | B / A | notes |", "| --- | --- | --- | --- | --- |",
             *wire.wire_rows(result["wire"])]
    for r in result["runtime"]:
        lines.append(f"| plan runtime's share of a Wan {STEPS[r['mode']]} ({wan}, {r['tokens']} tokens), the clock: "
                     f"step CPU (A) vs the runtime's CPU (B) | {r['step_ms']:.1f} ms ({r['untimed_ms']:.1f} untimed) "
                     f"| {r['plan_cpu_ms']:.2f} ms | **{100 * r['share']:.1f}%** | {r['calls']} timed calls; the "
                     f"clock's reads taken off: {r['plan_raw_cpu_ms'] - r['plan_cpu_ms']:.2f} ms "
                     f"({r['clock_us']['plan_cpu']:.2f} us a call, {r['clock_us']['excluded_cpu']:.2f} us a collective "
                     f"or kernel in one); ops through the SDPA-level mode: {r['mode_calls']} |")
    r = result.get("runtime_cost")
    if r is not None:
        low, high = r["paired_interval"]
        lines.append(f"| plan runtime's cost of a Wan forward (a denoising step; {wan}): made parallel by hand (A) "
                     f"vs by the plan (B), rank 0 of a fake world of {r['n']} | {r['hand_ms']:.1f} ms | "
                     f"{r['plan_ms']:.1f} ms | **{100 * r['paired_share']:.1f}%** [{100 * low:.1f}, {100 * high:.1f}] "
                     f"| CPU ms per forward, medians; the share: the median of {r['rounds']} rounds' paired "
                     "differences (B - A) over B's median, with a 95% bootstrap interval |")
    for mode, calls in result.get("compiled_runtime", {}).items():
        lines.append(f"| plan runtime's Python per Wan {STEPS[mode]} ({wan}): eager (A) vs torch.compile aot_eager "
                     f"(B) | {calls['eager']} calls | {calls['compiled']} calls | "
                     f"{calls['compiled'] / calls['eager']:.3f} | Python calls into dsp_plugin per step "
                     "(sys.setprofile, the slowest rank's); compiled, the hooks run inside the graph |")
    return "\n".join(lines)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    stem = out / f"costs_n{result['n']}"
    stem.with_suffix(".md").write_text(markdown(result) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return [stem.with_suffix(".md"), stem.with_suffix(".json")]
