"""The plan runtime's cost, A/B: the bench's Wan parallelized by its plan against the same Wan made parallel by hand.

    python -m dsp_plugin.bench.overhead --forward-only --against-hand [--size L,H,D,F,HW]
    python -m dsp_plugin.bench.overhead --forward-only --against-hand --ab-world gloo --rounds 300 [--ab-control]

The hand-written model is what a user would write without ``parallelize``: the
paper's functions called where ``WAN_PLAN`` puts its hooks, and nothing else (no
frames, tags read back, placement checks or argument binding):

- ``rope``'s (cos, sin) and the first block's tokens ``dsp_plugin.split`` on the
  token dim (whole frames: the bench's frame counts divide by N);
- every self-attention ``to_heads`` -> diffusers' own backend -> ``from_heads``,
  at diffusers' ``dispatch_attention_fn`` as Wan's processor calls it (text
  cross-attention, whose keys are not the video's tokens, passes through);
- ``proj_out``'s output ``dsp_plugin.gather`` on the token dim.

So the difference of the two forwards' times is the runtime's own Python over the
paper's API: an independent check of ``overhead``'s clock, which times the
runtime's pieces from inside. ``tests/test_bench_hand_wan.py`` shows the two models
give the one-process output on 2 gloo ranks (equal computations).

Rounds of a few steps alternate the two models (which goes first alternates too). The estimate is the
median of the rounds' *paired* differences (each round's plan step less the hand-written step run
beside it), with a 95% bootstrap interval: a machine's drift from round to round (a forward's CPU time
here moves by several ms) cancels in a pair where it does not in the difference of two minima or two
medians, which are printed beside it. ``control=True`` (``--ab-control``) runs the plan's Wan against a
second copy of itself, so the estimator's reading where nothing differs is measured, not assumed.

Two worlds: rank 0 of a world of N under torch's ``fake`` process group in ONE process
(``dsp_plugin.dryrun.world.fake_world``: the same Python path as a real rank, collectives that move
no data, no peer sharing the cores; the default, and the one on a GPU), or N gloo ranks
(``world="gloo"``, ``--ab-world gloo``: the bench's own setting, real collectives; a round's time is
its slowest rank's). A forward runs under ``no_grad`` (a denoising step); ``backward=True`` times a
training step. CPU time of the calling thread on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["hand_parallel", "markdown", "measure_against_hand", "median_interval"]


def hand_parallel(reference: Any, size: tuple[int, ...], group: Any = None) -> tuple[Any, Any]:
    """A copy of the bench's Wan (``bench.wan._setup(size)``'s model) parallel by hand on ``group``, and the
    context its forwards run in (the head switch at diffusers' dispatch, for this model's calls only)."""
    import diffusers.models.transformers.transformer_wan as wan

    from dsp_plugin import gather, split
    from dsp_plugin.comm import group_size
    from dsp_plugin.head_switch import from_heads, to_heads

    frames, hw, heads = size[3], (size[4] // 2) ** 2, size[1]
    n = group_size(group)
    if frames % n:  # split cuts tokens evenly; the plan cuts whole frames: the same only when frames divide
        raise ValueError(f"hand_parallel: {frames} latent frames over {n} ranks; expected a multiple of {n} (the "
                         f"hand-written split cuts tokens evenly, the plan whole frames)")
    model = copy.deepcopy(reference)
    tokens = frames * hw
    rope, first, proj_out = model.rope.forward, model.blocks[0].forward, model.proj_out.forward
    model.rope.forward = lambda x: tuple(split(t, 1, group=group) for t in rope(x))
    model.blocks[0].forward = lambda x, *args, **kwargs: first(split(x, 1, group=group), *args, **kwargs)
    model.proj_out.forward = lambda x: gather(proj_out(x), 1, group=group, global_len=tokens)
    original = wan.dispatch_attention_fn

    def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if key.shape[1] != query.shape[1]:  # cross-attention to the text: local
            return original(query, key, value, **kwargs)
        q, k, v = to_heads(query, key, value, seq_dim=1, head_dim=2, group=group, global_len=tokens)
        out = original(q, k, v, **kwargs)
        return from_heads(out, seq_dim=1, head_dim=2, group=group, global_len=tokens, heads=heads)

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        wan.dispatch_attention_fn = dispatch
        try:
            yield
        finally:
            wan.dispatch_attention_fn = original

    return model, running


def measure_against_hand(n: int = 2, size: tuple[int, ...] | None = None, *, rounds: int = 40,
                         per_round: int = 5, device: str = "cpu", backward: bool = False, world: str = "fake",
                         control: bool = False) -> dict[str, Any]:
    """ms per step of the plan's Wan and of the hand-written one over alternating rounds of ``per_round`` steps: the
    minimum and the median of each, their differences, and the median of the rounds' *paired* differences (each
    round's plan step less the hand's step beside it: slow drifts of the machine cancel) with a 95% bootstrap
    interval; each as a share of the plan's median step.

    ``world="fake"``: rank 0 of a fake world of ``n`` in this process (one CPU thread, as a bench rank; ``fake_world``
    refuses a process with torch.distributed initialised), CPU time of the thread. ``world="gloo"``: ``n`` gloo ranks
    (CPU only), each alternating the two models in the same order; a round's time is its slowest rank's CPU time.
    ``device="cuda:0"`` (fake world): the models and inputs there, and wall ms instead of CPU ms (a round ends when
    the device is done), so the runtime's Python counts only where it is not hidden behind the kernels it launches.
    ``backward=True``: a training step's forward and backward (of the output's mean square) instead.
    ``control=True``: the plan's Wan against a second copy of itself (an A/A run): what the estimator reads where
    nothing differs, its noise floor on this machine."""
    from dsp_plugin.bench.wan import SIZE

    size = tuple(size or SIZE)
    where = torch.device(device)
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"measure_against_hand: device={device!r}; expected 'cpu' or a CUDA device on a machine "
                         f"with one (CUDA available: {torch.cuda.is_available()})")
    if world not in ("fake", "gloo") or (world == "gloo" and where.type != "cpu"):
        raise ValueError(f"measure_against_hand: world={world!r} on device={device!r}; expected 'fake', or 'gloo' "
                         f"on the CPU")
    if world == "gloo":
        from dsp_plugin.spawn import spawn

        per_rank = spawn(_rank_rounds, n, size, rounds, per_round, backward, control, timeout=3600,
                         collective_timeout_s=300)
        plan_s = [max(times) for times in zip(*[r[0] for r in per_rank])]
        hand_s = [max(times) for times in zip(*[r[1] for r in per_rank])]
    else:
        from dsp_plugin.dryrun.world import fake_world

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
    """A 95% bootstrap interval of the median of ``values`` (percentiles of the resampled medians; seeded, so a
    run's table is reproducible from its times)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _rank_rounds(rank: int, n: int, size: tuple[int, ...], rounds: int, per_round: int, backward: bool,
                 control: bool) -> tuple[list[float], list[float]]:
    """One gloo rank of ``measure_against_hand(world="gloo")``: the installed topology's group, one CPU thread."""
    from dsp_plugin.log import quiet_third_party
    from dsp_plugin.topology import Topology, set_topology

    quiet_third_party()
    torch.set_num_threads(1)
    set_topology(Topology.world())
    return _rounds(torch.distributed.group.WORLD, size, rounds, per_round, torch.device("cpu"), backward, control)


def _rounds(group: Any, size: tuple[int, ...], rounds: int, per_round: int, where: torch.device, backward: bool,
            control: bool) -> tuple[list[float], list[float]]:
    """Seconds per step of the plan's Wan and of the other (hand-written, or with ``control`` a second plan copy),
    round by round, the order alternating."""
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup

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
    plan_s: list[float] = []
    other_s: list[float] = []
    for r in range(rounds):  # alternating which goes first
        for model in (plan, other) if r % 2 == 0 else (other, plan):
            (plan_s if model is plan else other_s).append(step(model))
    return plan_s, other_s


def markdown(result: dict[str, Any]) -> str:
    layers, heads, head_dim, frames, hw = result["size"]
    tokens = frames * (hw // 2) ** 2
    r = result
    step = "forward + backward" if r.get("backward") else "forward"
    clock = "CPU" if r.get("device", "cpu") == "cpu" else f"wall ({r['device']})"
    other = "a second plan copy (A/A)" if r.get("control") else "by hand"
    world = "gloo" if r.get("world") == "gloo" else "fake"
    low, high = r["paired_interval"]
    return "\n".join([
        f"| Wan (layers, heads x dim, tokens) | N ({world}), rounds | {step} {clock} ms, plan: min (median) "
        f"| {other}: min (median) | plan - other: minima (medians) | paired, ms: the rounds' differences' median "
        "| **the runtime's share**: paired [95% interval] (minima, medians) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {layers}, {heads} x {head_dim}, {tokens} | {r['n']}, {r['rounds']} | {r['plan_min_ms']:.2f} "
        f"({r['plan_ms']:.2f}) | {r['hand_min_ms']:.2f} ({r['hand_ms']:.2f}) | {r['diff_min_ms']:.3f} "
        f"({r['diff_ms']:.3f}) | {r['paired_ms']:.3f} | **{100 * r['paired_share']:.1f}%** [{100 * low:.1f}, "
        f"{100 * high:.1f}] ({100 * r['share_min']:.1f}%, {100 * r['share']:.1f}%) |"])
