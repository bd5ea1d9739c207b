"""The plan runtime's share of a step: the time spent in our own Python around a parallelized model.

    python -m dsp_plugin.bench.overhead --nproc 2 [--quick] [--rounds 20] [--where]
    python -m dsp_plugin.bench.overhead --size 4,12,16,16,32 --forward-only --rounds 9   # a larger Wan
    python -m dsp_plugin.bench.overhead --against-hand    # also: A/B against the Wan made parallel by hand
    python -m dsp_plugin.bench.overhead --against-hand --device cuda:0   # the A/B on a GPU (wall time)
    python -m dsp_plugin.bench.overhead --forward-only --against-hand --ab-world gloo --rounds 300 --ab-control

One Wan (``dsp_plugin.bench.wan``'s model and inputs) parallelized by its built-in plan on N gloo
ranks (CPU, fp32), timed per step (one forward under ``no_grad``, a denoising step, and one forward +
backward, a training step). In the timed steps every piece of the plan runtime is timed by a clock of
*exclusive* time (a nested piece's time is its own, never its caller's too):

- the plan's hooks: every forward pre-hook and hook ``parallelize`` registered with torch (the model's own,
  ``every_gradient``'s), found as the hooks the model has after ``parallelize`` and not before, and the
  ``Split``/``Block``/``Heads``/``Gather`` hooks of its modules, around their forwards (``plan.wrap``; torch's
  call path around a module is never timed here; ``--against-hand``'s A/B includes it);
- the head switch's wrapper at diffusers' attention dispatch (``plan.dispatch``) and ``HeadsCall.attend``;
- the backward of the plan's own autograd nodes (the partial split, the 1/N on the output, ``_Touch``);

less the time inside them that is not the runtime's bookkeeping: the collectives (``dynamic_switch``,
``gather``, the head switch's ``_to_heads``/``from_heads``, each with its own checks) and the attention
kernel. What is left is the runtime's Python (argument binding, frames, tags, checks, the split's
narrow and copy), reported as a share of the step (the slowest rank's step each round; the share is the
largest rank's), in wall time and in CPU time (the runtime's CPU time over the step's on the calling
thread: robust to other jobs preempting the ranks on a shared machine, and without the waits in the
collectives). Also counted: the ops that pass through the head switch's ``TorchFunctionMode`` (a Python
call each, while a ``Heads`` module runs; its cost is measured A/B against steps with it left off, and is 0
where no op passed through it: a module seen attending through diffusers' dispatch alone runs without it,
``plan.runtime``). The timed steps run beside untimed ones in alternating order,
so the clock's own cost shows as the difference of the two step times (``step_ms`` against ``untimed_ms``).
The part of it that lands inside the runtime's time (each timed call's clock reads and bookkeeping between its
own reads) is taken off the hooks' times, per timed and per excluded call, at what it costs where it runs:
a *probe step* (a fourth kind, in the same rotation) runs the plan untimed with a timed call that does nothing
at the start of each place a timed step times, and after each excluded call (``_Probes``). Right after the
model's kernels that code runs cold, at ~4 us CPU per call on this machine where a warm loop (``clock_cost``,
measured too) gives ~1 us; the median of the probe steps is taken off (never less than the warm loop's). The
table shows how much was taken off.

Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["measure", "markdown", "rows", "wan_step"]

MODES = ("forward", "train")


class _Clock:
    """Exclusive wall and CPU time per category over nested timed calls (one thread: on the CPU the ranks'
    backward runs on the thread that called it)."""

    def __init__(self) -> None:
        self.on = False
        self.without_mode = False
        self.probe: tuple[Any, Any] | None = None  # in a probe step: timed no-ops at the timed calls' places
        self.stack: list[tuple[str, str]] = []
        self.last = (0.0, 0.0)
        self.reset()

    def reset(self) -> None:
        self.wall = {"plan": 0.0, "excluded": 0.0}
        self.cpu = {"plan": 0.0, "excluded": 0.0}
        self.calls = {"plan": 0, "excluded": 0, "mode": 0}
        self.by: dict[str, float] = {}  # exclusive CPU time per timed function (where the time goes)

    def _charge(self, wall: float, cpu: float) -> None:
        category, label = self.stack[-1]
        self.wall[category] += wall - self.last[0]
        self.cpu[category] += cpu - self.last[1]
        self.by[label] = self.by.get(label, 0.0) + cpu - self.last[1]

    def timed(self, category: str, fn: Any, label: str | None = None) -> Any:
        label = label or f"{category}: {getattr(fn, '__qualname__', type(fn).__name__)}"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                if self.probe is None:
                    return fn(*args, **kwargs)
                if category == "plan":  # a timed call that does nothing, where this one would start
                    self.probe[0]()
                    return fn(*args, **kwargs)
                out = fn(*args, **kwargs)
                self.probe[1]()  # and where this excluded one returns to its caller's timed code
                return out
            wall, cpu = time.perf_counter(), time.thread_time()
            if self.stack:
                self._charge(wall, cpu)
            self.stack.append((category, label))
            self.calls[category] += 1
            self.last = (wall, cpu)
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter(), time.thread_time()
                self._charge(wall, cpu)
                self.stack.pop()
                self.last = (wall, cpu)

        return call


def clock_cost(calls: int = 4000) -> dict[str, float]:
    """What ``_Clock`` itself charges to the plan, in seconds, measured here and now: per timed plan call that does
    nothing (``"plan"``), and per excluded call inside one (``"excluded"``: the extra of a plan call whose only work
    is an excluded call that does nothing). Each is the clock's reads and bookkeeping that land between its own
    reads, wall and CPU (``"plan_cpu"``, ``"excluded_cpu"``), medians of 5 repeats. A warm loop: the same reads
    in a forward, between kernels, cost no less, so the correction it gives is an underestimate."""
    def per_call(make: Any) -> tuple[float, float]:
        walls, cpus = [], []
        for _ in range(5):
            clock = _Clock()
            fn = make(clock)
            clock.on = True
            for _ in range(calls):
                fn()
            walls.append(clock.wall["plan"] / calls)
            cpus.append(clock.cpu["plan"] / calls)
        return statistics.median(walls), statistics.median(cpus)

    def nothing() -> None:
        return None

    alone = per_call(lambda clock: clock.timed("plan", nothing))
    nested = per_call(lambda clock: clock.timed("plan", clock.timed("excluded", nothing)))
    return {"plan": alone[0], "plan_cpu": alone[1], "excluded": max(nested[0] - alone[0], 0.0),
            "excluded_cpu": max(nested[1] - alone[1], 0.0)}


def _nothing() -> None:
    return None


class _Probes:
    """Timed calls that do nothing, run in a *probe step* at the places of a timed step's timed calls (where each plan
    call starts, where each excluded call returns to timed code), while the step's own clock is off: what the
    clock's reads charge to the plan *there*, right after the model's kernels, where the same code runs cold and
    costs several times ``clock_cost``'s warm loop."""

    def __init__(self) -> None:
        self.before, self.after = _Clock(), _Clock()
        self.calls = (self.before.timed("plan", _nothing), self.after.timed("plan", _nothing))

    def start(self) -> None:
        for clock in (self.before, self.after):
            clock.reset()
            clock.on = True

    def per_call(self) -> dict[str, float]:
        """Seconds per timed call (``plan``) and per excluded one (``excluded``), wall and CPU, in the step probed."""
        out = {}
        for key, clock in (("plan", self.before), ("excluded", self.after)):
            n = max(clock.calls["plan"], 1)
            out[key], out[key + "_cpu"] = clock.wall["plan"] / n, clock.cpu["plan"] / n
        return out


def _hook_dicts(model: torch.nn.Module) -> list[dict[int, Any]]:
    return [d for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)]


def _instrument(clock: _Clock) -> None:
    """Patch this process (a spawned rank) so that the collectives and the attention kernels are excluded,
    and the plan's dispatch wrapper, ``attend`` and its autograd nodes' backward are timed as the plan's."""
    from dsp_plugin import every_gradient
    from dsp_plugin.head_switch import exchange
    from dsp_plugin.plan import attention, dispatch, ops

    for module, name in ((ops, "dynamic_switch"), (ops, "gather"), (exchange, "_to_heads"),
                         (exchange, "from_heads")):
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
    mode_fn = attention._HeadSwitchMode.__torch_function__

    def counted(*args: Any, **kwargs: Any) -> Any:  # an op through the head switch's function mode
        clock.calls["mode"] += clock.on
        return mode_fn(*args, **kwargs)

    attention._HeadSwitchMode.__torch_function__ = counted
    enter = attention._HeadSwitchMode.__enter__

    def entered(mode: Any) -> Any:  # the SDPA level left off (the A/B of its cost; Wan attends through dispatch)
        if clock.without_mode:
            mode.call.mode_entered = False
            return mode
        return enter(mode)

    attention._HeadSwitchMode.__enter__ = entered


def wan_step(model: Any, batch: tuple[torch.Tensor, ...], mode: str) -> None:
    """One step of the bench's Wan: ``"forward"`` under ``no_grad`` (a denoising step), else forward + backward."""
    if mode == "forward":
        with torch.no_grad():
            model(*batch, return_dict=False)
        return
    x = batch[0].clone().requires_grad_(True)
    model(x, *batch[1:], return_dict=False)[0].square().mean().backward()


def _worker(rank: int, n: int, size: tuple[int, ...], rounds: int, modes: tuple[str, ...]) -> dict[str, Any]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.plan.wrap import wrappers
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())
    clock = _Clock()
    _instrument(clock)
    reference, batch = _setup(size)
    model = copy.deepcopy(reference)
    before = {id(d): set(d) for d in _hook_dicts(model)}
    dsp_plugin.parallelize(model)
    for d in _hook_dicts(model):  # the hooks parallelize registered with torch (the model's own)
        for key in set(d) - before.get(id(d), set()):
            hook = d[key]
            label = f"plan: {hook.kind} hook of {hook.path!r}" if hasattr(hook, "path") else None
            d[key] = clock.timed("plan", hook, label)
    for wrapper in wrappers(model):  # and around its modules' forwards (plan/wrap.py), a block's bypass test too
        for side in ("pre", "post", "bypass"):
            hook = getattr(wrapper, side)
            if hook is not None:
                setattr(wrapper, side, clock.timed("plan", hook, f"plan: {hook.kind} hook of {hook.path!r}"))

    def step(mode: str) -> None:
        wan_step(model, batch, mode)

    out: dict[str, Any] = {"clock": clock_cost()}
    probes = _Probes()
    for mode in modes:
        for _ in range(2):  # warm-up: the first call's cross-rank checks, every_gradient's learning forward
            step(mode)
        keys = ("step", "step_cpu", "plan_raw", "plan_raw_cpu", "excluded", "untimed", "untimed_cpu",
                "without_mode_cpu", "calls", "excluded_calls", "mode_calls", "probed")
        rows: dict[str, Any] = {k: [] for k in keys} | {"by": {}}
        kinds = ["timed", "untimed", "without_mode", "probe"]
        for r in range(rounds):
            for kind in kinds[r % 4:] + kinds[:r % 4]:   # rotating order
                model.zero_grad(set_to_none=True)
                clock.reset()
                clock.on, clock.without_mode = kind == "timed", kind == "without_mode"
                if kind == "probe":
                    clock.probe = probes.calls
                    probes.start()
                start, start_cpu = time.perf_counter(), time.thread_time()
                step(mode)
                elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                clock.on = clock.without_mode = False
                clock.probe = None
                if kind == "untimed":
                    rows["untimed"].append(elapsed)
                    rows["untimed_cpu"].append(cpu)
                elif kind == "without_mode":
                    rows["without_mode_cpu"].append(cpu)
                elif kind == "probe":
                    rows["probed"].append(probes.per_call())
                if kind != "timed":
                    continue
                for key, value in (("step", elapsed), ("step_cpu", cpu), ("plan_raw", clock.wall["plan"]),
                                   ("plan_raw_cpu", clock.cpu["plan"]), ("excluded", clock.wall["excluded"]),
                                   ("calls", clock.calls["plan"]), ("excluded_calls", clock.calls["excluded"]),
                                   ("mode_calls", clock.calls["mode"])):
                    rows[key].append(value)
                for label, t in clock.by.items():
                    rows["by"].setdefault(label, []).append(t)
        # the clock's own reads, charged to the plan, taken off: what they cost where they ran (the probe steps'
        # median), never less than the warm loop's figure
        own = {k: max(statistics.median(p[k] for p in rows["probed"]), out["clock"][k]) for k in out["clock"]}
        rows["own"] = own
        for suffix in ("", "_cpu"):
            rows["plan" + suffix] = [raw - calls * own["plan" + suffix] - excluded * own["excluded" + suffix]
                                     for raw, calls, excluded in zip(rows["plan_raw" + suffix], rows["calls"],
                                                                     rows["excluded_calls"])]
        out[mode] = rows
    return out


def measure(n: int = 2, size: tuple[int, ...] | None = None, *, rounds: int = 20,
            modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """The plan runtime's time per step and its share, per mode (``forward``, ``train``), at Wan ``size``
    (``dsp_plugin.bench.wan``'s ``(layers, heads, head_dim, frames, height)``; default its bench size).

    Per round the slowest rank's step and the largest rank's plan time and share; then median and
    quartiles over the rounds (``bench.report.quantiles``). ``share``: wall time in the runtime over the
    step's wall time; ``cpu_share``: the runtime's CPU time over the step's CPU time on the calling thread
    (preemption by other jobs on the cores left out of both; waiting in a collective left out of the step).
    """
    from dsp_plugin.bench.report import quantiles
    from dsp_plugin.bench.wan import SIZE

    size = tuple(size or SIZE)
    per_rank = spawn(_worker, n, size, rounds, tuple(modes), timeout=900, collective_timeout_s=120)
    result: dict[str, Any] = {"n": n, "size": size, "rounds": rounds, "tokens": size[3] * (size[4] // 2) ** 2}

    def slowest(key: str) -> list[float]:
        return [max(values) for values in zip(*(r[key] for r in ranks))]

    def largest_share(part: str, whole: str) -> list[float]:
        return [max(p / w for p, w in zip(ps, ws)) for ps, ws in
                zip(zip(*(r[part] for r in ranks)), zip(*(r[whole] for r in ranks)))]

    def mode_share(r: dict[str, Any]) -> list[float]:  # the SDPA level's cost over the step, CPU, per round
        if not any(r["mode_calls"]):  # no op went through it: the A/B compares two identical steps (noise)
            return [0.0] * len(r["untimed_cpu"])
        return [(a - b) / a for a, b in zip(r["untimed_cpu"], r["without_mode_cpu"])]

    for mode in modes:
        ranks = [r[mode] for r in per_rank]
        for r in ranks:
            r["mode_share"] = mode_share(r)
            r["total_share"] = [p / s + m for p, s, m in zip(r["plan_cpu"], r["step_cpu"], r["mode_share"])]
            r["mode_cpu"] = [(a - b) * any(r["mode_calls"]) for a, b in zip(r["untimed_cpu"], r["without_mode_cpu"])]
        plan = quantiles(slowest("plan"))
        calls = ranks[0]["calls"][0]
        result[mode] = {"step_s": quantiles(slowest("step")), "untimed_s": quantiles(slowest("untimed")),
                        "plan_s": plan, "plan_cpu_s": quantiles(slowest("plan_cpu")),
                        "plan_raw_cpu_s": quantiles(slowest("plan_raw_cpu")),
                        "clock_us": {k: 1e6 * max(r["own"][k] for r in ranks) for k in ranks[0]["own"]},
                        "clock_warm_us": {k: 1e6 * max(r["clock"][k] for r in per_rank) for k in per_rank[0]["clock"]},
                        "excluded_s": quantiles(slowest("excluded")),
                        "share": quantiles(largest_share("plan", "step")),
                        "cpu_share": quantiles(largest_share("plan_cpu", "step_cpu")),
                        "mode_cpu_s": quantiles(slowest("mode_cpu")), "mode_share": quantiles(slowest("mode_share")),
                        "total_share": quantiles(slowest("total_share")),
                        "calls": calls, "mode_calls": ranks[0]["mode_calls"][0],
                        "per_call_us": 1e6 * plan["median"] / max(calls, 1),
                        "by": dict(sorted(((label, statistics.median(ts)) for label, ts in ranks[0]["by"].items()),
                                          key=lambda kv: -kv[1]))}
    return result


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per mode (medians over the rounds): what the bench's tables print."""
    out = []
    for mode in MODES:
        r = result.get(mode)
        if r is None:
            continue
        med = {k: v["median"] for k, v in r.items() if isinstance(v, dict) and "median" in v}
        out.append({"mode": mode, "n": result["n"], "size": result["size"], "tokens": result["tokens"],
                    "step_ms": 1e3 * med["step_s"], "untimed_ms": 1e3 * med["untimed_s"],
                    "plan_ms": 1e3 * med["plan_s"], "plan_cpu_ms": 1e3 * med["plan_cpu_s"],
                    "plan_raw_cpu_ms": 1e3 * med["plan_raw_cpu_s"], "clock_us": r["clock_us"],
                    "clock_warm_us": r["clock_warm_us"],
                    "excluded_ms": 1e3 * med["excluded_s"], "share": med["share"],
                    "share_p25": r["share"]["p25"], "share_p75": r["share"]["p75"], "cpu_share": med["cpu_share"],
                    "mode_cpu_ms": 1e3 * med["mode_cpu_s"], "mode_share": med["mode_share"],
                    "total_share": med["total_share"], "calls": r["calls"], "mode_calls": r["mode_calls"],
                    "per_call_us": r["per_call_us"]})
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| Wan (layers, heads x dim, tokens) | N | step | step ms (untimed) | hooks ms, wall (CPU) | "
             "clock's reads taken off, CPU ms | hooks' share, wall [IQR] | hooks' share, CPU | "
             "SDPA-level mode ms CPU (ops) | runtime's share, CPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        layers, heads, head_dim = result["size"][:3]
        for r in rows(result):
            lines.append(f"| {layers}, {heads} x {head_dim}, {r['tokens']} | {r['n']} | {r['mode']} | "
                         f"{r['step_ms']:.1f} ({r['untimed_ms']:.1f}) | {r['plan_ms']:.2f} ({r['plan_cpu_ms']:.2f}) | "
                         f"{r['plan_raw_cpu_ms'] - r['plan_cpu_ms']:.2f} | "
                         f"{100 * r['share']:.1f}% [{100 * r['share_p25']:.1f}-{100 * r['share_p75']:.1f}] | "
                         f"{100 * r['cpu_share']:.1f}% | {r['mode_cpu_ms']:.2f} ({r['mode_calls']}) | "
                         f"**{100 * r['total_share']:.1f}%** |")
    for result in results:
        for r in rows(result):
            taken, warm = r["clock_us"], r["clock_warm_us"]
            lines.append(f"\n{r['mode']}: the clock's own reads taken off the hooks' times, measured in each rank where "
                         f"they ran (probe steps): {taken['plan_cpu']:.2f} us CPU per timed call, "
                         f"{taken['excluded_cpu']:.2f} us per collective or kernel inside one (a warm loop, "
                         f"``clock_cost``: {warm['plan_cpu']:.2f} and {warm['excluded_cpu']:.2f}; the largest rank's).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dsp_plugin.bench.wan import QUICK, SIZE

    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--quick", action="store_true", help=f"only the small Wan {QUICK}")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per mode (default 20)")
    parser.add_argument("--where", action="store_true", help="also rank 0's exclusive CPU time per timed function")
    parser.add_argument("--size", default=None, metavar="L,H,D,F,HW",
                        help="one Wan size instead: layers, heads, head dim, latent frames, latent height = width")
    parser.add_argument("--forward-only", action="store_true", help="only the forward (no training step)")
    parser.add_argument("--against-hand", action="store_true",
                        help="also time the forward against the same Wan made parallel by hand, A/B in one process "
                             "(dsp_plugin.bench.hand_wan)")
    parser.add_argument("--device", default="cpu",
                        help="with --against-hand: where the A/B runs (default cpu: CPU time; cuda:0: wall time)")
    parser.add_argument("--ab-world", default="fake", choices=("fake", "gloo"),
                        help="with --against-hand: rank 0 of a fake world in this process (default), or --nproc gloo "
                             "ranks")
    parser.add_argument("--ab-control", action="store_true",
                        help="with --against-hand: also the plan's Wan against a second copy of itself (A/A), the "
                             "A/B estimator's noise floor")
    args = parser.parse_args(argv)
    sizes = [QUICK] if args.quick else [SIZE, QUICK]
    if args.size is not None:
        sizes = [tuple(int(v) for v in args.size.split(","))]
    modes = ("forward",) if args.forward_only else MODES
    results = [measure(args.nproc, s, rounds=args.rounds, modes=modes) for s in sizes]
    print(markdown(results))
    if args.against_hand:
        from dsp_plugin.bench import hand_wan

        world = (f"{args.nproc} gloo ranks" if args.ab_world == "gloo" else
                 f"rank 0 of a fake world of {args.nproc} on {args.device}")
        print(f"\nA/B, the plan's Wan against the Wan made parallel by hand ({world}, ms per step over alternating "
              "rounds):")
        for size in sizes:
            for backward in (False,) if args.forward_only else (False, True):
                for control in (False, True) if args.ab_control else (False,):
                    print(hand_wan.markdown(hand_wan.measure_against_hand(
                        args.nproc, size, rounds=max(args.rounds, 40), device=args.device, backward=backward,
                        world=args.ab_world, control=control)))
    if args.where:
        for result in results:
            for mode in modes:
                print(f"\n{result['size']} {mode}: rank 0's exclusive CPU ms per step, median over the rounds")
                for label, t in result[mode]["by"].items():
                    print(f"  {1e3 * t:8.3f}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
