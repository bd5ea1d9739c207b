"""Latency table for DSP sampling of the tiny LattePipeline: 1, 2, 4 CPU processes (a command, not a test).

    python -m dsp_plugin.bench.latency --md docs/inference_latency.md --png docs/inference_latency.png

Per denoising step and per rank it reports the measured median latency and the
bytes sent (``CommAccounting``) for DSP with the latents sharded across the
loop; the bytes of an approach that gathers the latents every step (the
transformer wrapped with full input and output, i.e. ``LatteDSP.forward`` each
step: split, the same switches, then an all_gather of the prediction), measured
the same way; and a Ulysses-style sequence parallel attention from its formula
(4 all-to-alls of q, k, v, o per attention block needing the sharded dim, as in
``dsp_plugin.bench.scale_model``). Finally the H100 forward-only prediction
(alpha-beta model of ``dsp_plugin.bench``) for a Latte-sized model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

__all__ = ["main", "measure"]


def _worker(rank: int, n: int, frames: int, steps: int, size: int, layers: int) -> dict[str, Any]:
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()                 # third-party notices stay out of the tables
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.adapters.latte import LatteDSP
    from dsp_plugin.backend import current_device, synchronize
    from dsp_plugin.pipelines.frame_sharded import sampling_groups
    from dsp_plugin.pipelines.latte_sampler import parallelize_latte_pipeline
    from dsp_plugin.testing.tiny import tiny_latte_pipeline, tiny_prompt_embeds

    device = current_device()                  # the GPU of this rank under NCCL (dsp_plugin.backend)
    pipe = tiny_latte_pipeline(frames=frames, layers=layers, sample_size=size // 2).to(device)
    pipe.set_progress_bar_config(disable=True)
    dsp_group, _ = sampling_groups(cfg_parallel=False)
    sampler = parallelize_latte_pipeline(pipe, dsp_group=dsp_group)
    prompt, negative = (t.to(device) for t in tiny_prompt_embeds())
    kwargs = {"prompt_embeds": prompt, "negative_prompt": None, "negative_prompt_embeds": negative,
              "video_length": frames, "height": size, "width": size, "guidance_scale": 4.0, "output_type": "latent"}
    sampler(**kwargs, num_inference_steps=1, generator=torch.Generator().manual_seed(0))   # warm-up
    marks: list[tuple[float, int]] = []
    with CommAccounting(activations=False) as acct:
        def on_step(pipe: object, i: int, t: object, kwargs: dict) -> dict:
            synchronize(device)
            marks.append((time.perf_counter(), sum(r.bytes_sent for r in acct.records)))
            return {}

        synchronize(device)
        marks.append((time.perf_counter(), 0))
        sampler(**kwargs, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                callback_on_step_end=on_step)
    step_s = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    step_bytes = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    # gather-every-step: the transformer with full input/output on the same CFG batch
    latents = torch.randn(2, 4, frames, size // 2, size // 2, device=device)
    with torch.no_grad(), CommAccounting(activations=False) as full:
        LatteDSP(pipe.transformer, group=dsp_group)(latents, timestep=torch.tensor([500, 500], device=device),
                                                    encoder_hidden_states=torch.cat([negative, prompt]))
    return {"step_ms": 1e3 * statistics.median(step_s), "dsp_bytes": max(step_bytes),
            "gather_bytes": sum(r.bytes_sent for r in full.records)}


def ulysses_bytes(*, batch: int, frames: int, tokens: int, hidden: int, layers: int, n: int,
                  element: int = 4) -> float:
    """Per rank per step: 4 all-to-alls (q, k, v, o) of the local activation in each temporal block.

    Ulysses shards the sequence and re-shards to heads only around the attention
    that needs the sharded dim (one of the two blocks of a layer, as in
    ``dsp_plugin.bench.scale_model``): 4 * M/N * (N-1)/N per layer.
    """
    m = batch * frames * tokens * hidden * element
    return layers * 4 * (m / n) * (n - 1) / n


def dsp_formula_bytes(*, batch: int, frames: int, tokens: int, hidden: int, layers: int, n: int,
                      element: int = 4) -> float:
    """Per rank per step: 2 all-to-alls per layer of the local activation, (N-1)/N of it leaving."""
    m = batch * frames * tokens * hidden * element
    return layers * 2 * (m / n) * (n - 1) / n


def measure(*, frames: int, steps: int, size: int, layers: int, worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    from dsp_plugin.spawn import spawn

    rows = []
    hidden, tokens = 16, (size // 2 // 2) ** 2          # tiny_latte: 2 heads x 8; patch 2 on size/2 latents
    start = time.perf_counter()
    for i, n in enumerate(worlds):
        print(f"[latency {time.perf_counter() - start:6.1f}s] {i + 1}/{len(worlds)}: {n} process(es), "
              f"warm-up + {steps} steps", file=sys.stderr, flush=True)
        results = spawn("dsp_plugin.bench.latency:_worker", n, frames, steps, size, layers, timeout=900,
                        collective_timeout_s=300, backend="auto")
        shape = {"batch": 2, "frames": frames, "tokens": tokens, "hidden": hidden, "layers": layers, "n": n}
        rows.append({"n": n, "step_ms": max(r["step_ms"] for r in results),
                     "dsp_bytes": max(r["dsp_bytes"] for r in results),
                     "dsp_formula": dsp_formula_bytes(**shape),
                     "gather_bytes": max(r["gather_bytes"] for r in results),
                     "ulysses_bytes": ulysses_bytes(**shape)})
    print(f"[latency {time.perf_counter() - start:6.1f}s] done", file=sys.stderr, flush=True)
    return rows


def h100_prediction(worlds: tuple[int, ...] = (1, 2, 4, 8)) -> list[tuple[int, float, float]]:
    """Forward-only step (ms) of a Latte-sized model (720M: 28 layers, 1152 hidden), T=16, S=4096, batch 2 (CFG).

    ``dsp_plugin.bench.scale_model.predict`` with its inference factors (one forward, no
    recompute; NVLink inside a node, bf16): DSP against the best-practice Ulysses
    (packed q/k/v all-to-all and one for the output around the temporal attention).
    """
    from dsp_plugin.bench import params
    from dsp_plugin.bench.scale_model import INFERENCE, predict

    model = params.MODELS["720M"]
    out = []
    for n in worlds:
        dsp, uly = (predict(m, model, batch=2, temporal=16, sp=n, factors=INFERENCE) for m in ("dsp", "ulysses"))
        out.append((n, 1e3 * dsp.step_s if dsp.feasible else float("nan"),
                    1e3 * uly.step_s if uly.feasible else float("nan")))
    return out


def _where() -> str:
    from dsp_plugin.backend import choose

    rt = choose()
    return "NCCL, one GPU per rank" if rt.backend == "nccl" else "CPU gloo, 1 thread per rank"


def render(rows: list[dict[str, Any]], prediction: list[tuple[int, float, float]], args: Any) -> str:
    base = rows[0]["step_ms"]
    lines = [f"Tiny LattePipeline, {args.frames} frames, {args.size}x{args.size} px, {args.layers} layers, "
             f"CFG batch 2, {args.steps} steps; {_where()}; bytes sent per rank per step.",
             "", "| processes | step (ms) | speed-up | DSP bytes (measured) | DSP bytes (2M(N-1)/N² per layer) "
             "| gather-every-step bytes | Ulysses-style bytes (formula) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['step_ms']:.1f} | {base / r['step_ms']:.2f}x | {r['dsp_bytes']:,} | "
                     f"{r['dsp_formula']:,.0f} | {r['gather_bytes']:,} | {r['ulysses_bytes']:,.0f} |")
    lines += ["", "H100 prediction (alpha-beta model, forward only, 720M Latte-sized model, T=16, S=4096, "
              "batch 2, bf16):", "", "| GPUs | DSP step (ms) | Ulysses-style step (ms) |", "|---|---|---|"]
    lines += [f"| {n} | {d:.1f} | {u:.1f} |" for n, d, u in prediction]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    ns = [r["n"] for r in rows]
    a.plot(ns, [r["step_ms"] for r in rows], "o-")
    a.set(xlabel="processes", ylabel="ms per denoising step", title="measured latency (CPU)", xticks=ns)
    for key, label in (("dsp_bytes", "DSP (sharded latents)"), ("gather_bytes", "gather every step"),
                       ("ulysses_bytes", "Ulysses-style (formula)")):
        b.plot(ns, [r[key] / 1e3 for r in rows], "o-", label=label)
    b.set(xlabel="processes", ylabel="kB sent per rank per step", title="communication", xticks=ns)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--md", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    rows = measure(frames=args.frames, steps=args.steps, size=args.size, layers=args.layers, worlds=worlds)
    text = render(rows, h100_prediction(), args)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.png:
        plot(rows, args.png)
    return text


if __name__ == "__main__":
    main()
