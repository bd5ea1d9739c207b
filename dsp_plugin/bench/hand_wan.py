"""The plan runtime's cost, A/B: the bench's Wan parallelized by its plan against the same Wan made parallel by hand.

    python -m dsp_plugin.bench.overhead --forward-only --against-hand [--size L,H,D,F,HW]

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

Timed in ONE process, as rank 0 of a world of N under torch's ``fake`` process group
(``dsp_plugin.dryrun.world.fake_world``): the same Python path as a real rank, collectives that
move no data and no peer sharing the cores, one forward under ``no_grad`` (a denoising step),
CPU time of the thread. Rounds of a few forwards alternate the two models. The estimate is the
difference of the minima over the rounds (noise only adds time); the medians' difference is
printed beside it. On 2 gloo ranks sharing this machine's 2 cores the same A/B scattered from -1%
to 9% between runs (docs/benchmarks.md), too wide to resolve a few percent. The share is of a
forward without communication, so a real rank's share of its step is smaller by that much.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["hand_parallel", "markdown", "measure_against_hand"]


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
                         per_round: int = 5, device: str = "cpu", backward: bool = False) -> dict[str, Any]:
    """CPU ms per forward of the plan's Wan and of the hand-written one, as rank 0 of a fake world of ``n``, in
    this process (one CPU thread, as a bench rank; ``fake_world`` refuses a process with torch.distributed
    initialised): the minimum and the median over alternating rounds of ``per_round`` forwards, the differences
    of each, and the share of the plan's forward they are.

    ``device="cuda:0"``: the models and inputs there, and wall ms instead of CPU ms (a round ends when the device
    is done), so the runtime's Python counts only where it is not hidden behind the kernels it launches.
    ``backward=True``: a training step's forward and backward (of the output's mean square) instead."""
    import dsp_plugin
    from dsp_plugin.bench.wan import SIZE, _setup
    from dsp_plugin.dryrun.world import fake_world

    size = tuple(size or SIZE)
    where = torch.device(device)
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"measure_against_hand: device={device!r}; expected 'cpu' or a CUDA device on a machine "
                         f"with one (CUDA available: {torch.cuda.is_available()})")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fake_world(n, dsp=n):
            reference, batch = _setup(size)
            reference, batch = reference.to(where), tuple(t.to(where) for t in batch)
            plan = dsp_plugin.parallelize(copy.deepcopy(reference))
            hand, running = hand_parallel(reference, size)
            clock = time.thread_time if where.type == "cpu" else time.perf_counter

            def forward(model: Any) -> float:
                context = running() if model is hand else contextlib.nullcontext()
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
                forward(plan), forward(hand)
            plan_s: list[float] = []
            hand_s: list[float] = []
            for r in range(rounds):  # alternating which goes first
                for model in (plan, hand) if r % 2 == 0 else (hand, plan):
                    (plan_s if model is plan else hand_s).append(forward(model))
    finally:
        torch.set_num_threads(threads)
    p, h, p_min, h_min = statistics.median(plan_s), statistics.median(hand_s), min(plan_s), min(hand_s)
    return {"n": n, "size": size, "rounds": rounds, "device": device, "backward": backward,
            "plan_ms": 1e3 * p, "hand_ms": 1e3 * h,
            "diff_ms": 1e3 * (p - h), "share": (p - h) / p, "plan_min_ms": 1e3 * p_min, "hand_min_ms": 1e3 * h_min,
            "diff_min_ms": 1e3 * (p_min - h_min), "share_min": (p_min - h_min) / p_min}


def markdown(result: dict[str, Any]) -> str:
    layers, heads, head_dim, frames, hw = result["size"]
    tokens = frames * (hw // 2) ** 2
    r = result
    step = "forward + backward" if r.get("backward") else "forward"
    clock = "CPU" if r.get("device", "cpu") == "cpu" else f"wall ({r['device']})"
    return "\n".join([
        f"| Wan (layers, heads x dim, tokens) | N (fake) | {step} {clock} ms, plan: min (median) "
        "| by hand: min (median) | plan - hand: minima (medians) | **the runtime's share**: minima (medians) |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {layers}, {heads} x {head_dim}, {tokens} | {r['n']} | {r['plan_min_ms']:.2f} ({r['plan_ms']:.2f}) | "
        f"{r['hand_min_ms']:.2f} ({r['hand_ms']:.2f}) | {r['diff_min_ms']:.3f} ({r['diff_ms']:.3f}) | "
        f"**{100 * r['share_min']:.1f}%** ({100 * r['share']:.1f}%) |"])
