"""The full-3D row: Wan through ``dsp_plugin.parallelize`` against diffusers' own Ulysses, in one run.

    python -m dsp_plugin.bench.wan --nproc 2 [--quick]    # also a section of python -m dsp_plugin.bench

On N gloo ranks (CPU, fp32), the same ``WanTransformer3DModel`` (random
weights) and the same inputs, three ways: our plan (``dsp_plugin.parallelize``:
the head switch, q, k, v packed in one all-to-all and the output in one more),
diffusers 0.42's own Ulysses (``ContextParallelConfig(ulysses_degree=N)``: q, k
and v with one all-to-all each and the output with a fourth; how it is turned on
without an accelerator: ``dsp_plugin.bench.diffusers_cp``), and the unmodified
model on one process. Per method: all-to-alls and bytes per layer and the exit
all-gather (``CommAccounting``, rank 0), the max |difference| from the one
process output over the ranks, and one forward's time (a denoising step;
diffusers' context parallelism is for inference). The two parallel methods are
timed in the same rounds, in alternating order, and their time ratio is taken
round by round (the slowest rank's time each), then summarised as median
[interquartile range] (min-max), wall and CPU time (user + system, gloo's
threads included: another job's time on the cores left out).

Both split the same tokens when the frames divide by N: our plan shards whole
frames of tokens (so sampling keeps the latents sharded on frames), diffusers'
chunks the flat token sequence; both gather after ``proj_out``. The quick and
default shapes have frames and heads divisible by 2 and 4, the two ways' bytes
are then equal; only the number of all-to-alls (2 against 4 per layer) and
the copies around them differ.

Also here: one step of the bench's Wan (``wan_step``) and the same Wan made parallel by hand
(``hand_parallel``), the baseline of ``bench.costs``' A/B of what the plan runtime costs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["QUICK", "ROUNDS", "SIZE", "hand_parallel", "main", "markdown", "wan_row", "wan_step"]

#: (layers, heads, head_dim, frames, height = width of the latents); patch (1, 2, 2)
QUICK = (2, 4, 8, 4, 8)    # 4 x 4 x 4 = 64 tokens, hidden 32
SIZE = (4, 12, 16, 8, 16)  # 8 x 8 x 8 = 512 tokens, hidden 192
METHODS = ("ours", "diffusers")
ROUNDS = 20  # timed rounds by default


def _setup(size: tuple[int, ...]) -> tuple[Any, tuple[torch.Tensor, ...]]:
    from dsp_plugin.testing.tiny import tiny_wan

    layers, heads, head_dim, frames, hw = size
    model = tiny_wan(layers=layers, heads=heads, head_dim=head_dim)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(1, 4, frames, hw, hw, generator=g), torch.tensor([500]),
             torch.randn(1, 7, 16, generator=g))
    return model, batch


def wan_step(model: Any, batch: tuple[torch.Tensor, ...], mode: str) -> None:
    """One step of the bench's Wan: ``"forward"`` under ``no_grad`` (a denoising step), else forward + backward."""
    if mode == "forward":
        with torch.no_grad():
            model(*batch, return_dict=False)
        return
    x = batch[0].clone().requires_grad_(True)
    model(x, *batch[1:], return_dict=False)[0].square().mean().backward()


def hand_parallel(reference: Any, size: tuple[int, ...], group: Any = None) -> tuple[Any, Any]:
    """A copy of the bench's Wan (``bench.wan._setup(size)``'s) parallel by hand on ``group``, and the context its
    forwards run in: ``rope``'s (cos, sin) and the first block's tokens ``split``, each self-attention ``to_heads``
    -> diffusers' own backend -> ``from_heads`` (the text's cross-attention local), ``proj_out``'s output gathered."""
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


def _worker(rank: int, n: int, size: tuple[int, ...], steps: int) -> dict[str, Any]:
    from dsp_plugin.bench import diffusers_cp

    diffusers_cp.prepare_rank()         # third-party notices out of the tables; the world the DSP group
    import dsp_plugin
    reference, batch = _setup(size)
    layers, heads = size[0], size[1]
    tokens = size[3] * (size[4] // 2) ** 2
    models = {"ours": dsp_plugin.parallelize(copy.deepcopy(reference))}
    refused = diffusers_cp.refusal(heads, tokens, n)
    out: dict[str, Any] = {"layers": layers, "heads": heads, "tokens": tokens, "refused": refused}
    if refused is None:
        theirs = copy.deepcopy(reference)
        out["diffusers_how"] = diffusers_cp.enable_ulysses(theirs, n)
        models["diffusers"] = theirs
    with torch.no_grad():
        expected = reference(*batch, return_dict=False)[0]
    for name, model in models.items():
        out[name] = diffusers_cp.account(lambda m=model: [m(*batch, return_dict=False)[0]], [expected])
    times: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    with torch.no_grad():
        for step in range(steps + 1):        # round 0 warms up, not kept
            for name in (names if step % 2 == 0 else names[::-1]):
                start, start_cpu = time.perf_counter(), time.process_time()
                models[name](*batch, return_dict=False)
                if step:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
        one = []
        if rank == 0:                        # after the rounds: the other ranks have nothing to wait on
            for _ in range(max(3, steps // 3)):
                start = time.perf_counter()
                reference(*batch, return_dict=False)
                one.append(time.perf_counter() - start)
    return out | {"times": times, "cpu": cpu, "one_process_s": one}


def wan_row(n: int, *, quick: bool = False, steps: int = ROUNDS, size: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Rank 0's counts, the max difference over the ranks, and the per-round times and ratios."""
    from dsp_plugin.bench.report import quantiles

    size = size or (QUICK if quick else SIZE)
    rows = spawn(_worker, n, size, steps, timeout=600, collective_timeout_s=120)
    row = {k: v for k, v in rows[0].items() if k not in ("times", "cpu")}
    row["n"], row["size"], row["steps"] = n, size, steps
    for name in METHODS:
        if name not in row:
            continue
        row[name]["max_diff"] = max(r[name]["max_diff"] for r in rows)
        row[name]["all_to_all_per_layer"] = row[name]["all_to_all"] / row["layers"]
        rounds = [max(ts) for ts in zip(*(r["times"][name] for r in rows))]
        row[name]["rounds_s"] = rounds
        row[name]["step_s"] = quantiles(rounds)
        row[name]["cpu_rounds_s"] = [max(ts) for ts in zip(*(r["cpu"][name] for r in rows))]
    if "diffusers" in row:
        ours, theirs = row["ours"], row["diffusers"]
        row["ratio"] = quantiles([a / b for a, b in zip(ours["rounds_s"], theirs["rounds_s"])])
        row["cpu_ratio"] = quantiles([a / b for a, b in zip(ours["cpu_rounds_s"], theirs["cpu_rounds_s"])])
    row["one_process"] = quantiles(row.pop("one_process_s"))
    return row


def _spread(q: dict[str, float]) -> str:
    return f"{q['median']:.2f} [{q['p25']:.2f}-{q['p75']:.2f}] ({q['min']:.2f}-{q['max']:.2f})"


def markdown(row: dict[str, Any]) -> str:
    import diffusers

    from dsp_plugin.bench.diffusers_cp import WHY

    n, layers = row["n"], row["layers"]
    _, heads, head_dim, frames, hw = row["size"]
    lines = [f"Wan (diffusers WanTransformer3DModel, random weights): {layers} layers, {heads} heads x {head_dim}, "
             f"latents {frames} frames x {hw}x{hw} = {row['tokens']} tokens; N={n} gloo ranks, CPU, fp32; one forward "
             f"(a denoising step); bytes sent by rank 0; {row['steps']} timed rounds, the two parallel methods "
             "alternating in each.", "",
             "| method | all-to-alls per layer | all-to-all bytes per layer | exit all-gathers (bytes) | "
             "max abs diff vs one process | forward ms (median) |", "| --- | --- | --- | --- | --- | --- |"]
    labels = {"ours": "dsp_plugin.parallelize (head switch: q, k, v packed)",
              "diffusers": f"diffusers {diffusers.__version__} Ulysses (ulysses_degree={n}; q, k, v apart)"}
    for name in METHODS:
        r = row.get(name)
        if r is None:
            lines.append(f"| {labels[name]} | 4 (formula) | {row['refused']} | 1 (formula) | - | - |")
            continue
        lines.append(f"| {labels[name]} | {r['all_to_all_per_layer']:g} | {r['a2a_bytes'] // layers:,} | "
                     f"{r['all_gather']} ({r['gather_bytes']:,}) | {r['max_diff']:.1e} | "
                     f"{1e3 * r['step_s']['median']:.1f} |")
    lines.append(f"| unmodified model, one process | 0 | 0 | 0 | 0 | {1e3 * row['one_process']['median']:.1f} |")
    lines.append("")
    if "ratio" in row:
        lines.append(f"Time ours / diffusers, same round: wall {_spread(row['ratio'])}, CPU "
                     f"{_spread(row['cpu_ratio'])} (median [interquartile range] (min-max) over the rounds).")
        lines.append(f"diffusers' side: its own code via {row['diffusers_how']}: {WHY}.")
    else:
        lines.append(f"diffusers' side by formula from its code (TemplatedUlyssesAttention): {row['refused']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.wan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK[0]} layers, {QUICK[1]} heads, {QUICK[3] * (QUICK[4] // 2) ** 2} tokens")
    parser.add_argument("--steps", type=int, default=ROUNDS, help=f"timed rounds (default {ROUNDS})")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: expected at least 1 timed round")
    print(markdown(wan_row(args.nproc, quick=args.quick, steps=args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
