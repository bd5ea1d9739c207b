"""``python -m dsp_plugin.bench.memory``: activation memory per rank against the DSP size N, measured.

    python -m dsp_plugin.bench.memory                          # N = 1, 2, 4; 16 frames, 4096 video tokens
    python -m dsp_plugin.bench.memory --nproc 1 2 --memory-gib 80 --model 3B

Each rank runs one forward of the reference STDiT (adaLN, cross-attention to a replicated
text embedding) under ``CommAccounting``, which adds up the bytes autograd saves for the
backward (``saved_activation_bytes``: what activation memory is, weights and optimizer
state aside). The video is sharded over DSP; the text is not. So per rank

    saved(N) = a * V / N + b           V video tokens, b the replicated (text) part

and the table shows how close to 1/N it gets at the chosen video-to-text proportion.
``a`` and ``b`` are fitted from the smallest and largest N measured; the last table scales
them to a paper-sized model (linearly in hidden size and depth, to ``--bytes`` per element)
and prints the longest video whose saved activations fit in ``--memory-gib`` per GPU.
That last table is a prediction from the measured bytes; weights, gradients, optimizer
state and framework workspace come on top.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["fit", "main", "measure"]

# the paper's models (Table 4); 1024 latent tokens per frame is a 512x512 video (VAE /8, patch 2)
MODELS = {"720M": (28, 1152), "3B": (36, 2048)}
TOKENS_PER_FRAME_512PX = 1024


def _worker(rank: int, n: int, shape: dict[str, int]) -> int:
    from dsp_plugin import parallelize
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.backend import current_device
    from dsp_plugin.log import quiet_third_party
    from dsp_plugin.models import STDiT, STDiTConfig
    from dsp_plugin.topology import Topology, set_topology

    quiet_third_party()                 # third-party notices stay out of the tables

    set_topology(Topology.world())   # the whole world is the DSP group (group=None refuses without one)
    device = current_device()
    torch.manual_seed(0)
    cfg = STDiTConfig(depth=shape["depth"], hidden_size=shape["hidden"], num_heads=shape["heads"],
                      text_dim=shape["hidden"])
    model = STDiT(cfg).to(device)
    if n > 1:
        parallelize(model)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, shape["frames"], shape["size"], shape["size"], generator=g).to(device)
    text = torch.randn(1, shape["text_len"], shape["hidden"], generator=g).to(device)
    with CommAccounting() as acct:
        model(latents, torch.tensor([500.0], device=device), text)
    return acct.saved_activation_bytes


def measure(nprocs: list[int], shape: dict[str, int]) -> list[dict[str, Any]]:
    rows, start = [], time.perf_counter()
    video = shape["frames"] * (shape["size"] // 2) ** 2
    for i, n in enumerate(nprocs):
        print(f"[memory {time.perf_counter() - start:6.1f}s] {i + 1}/{len(nprocs)}: N={n}", file=sys.stderr, flush=True)
        per_rank = spawn(_worker, n, shape, backend="auto", timeout=600, collective_timeout_s=300)
        rows.append({"n": n, "video_tokens": video, "saved_bytes": max(per_rank)})
    return rows


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """``(a, b)`` of ``saved(N) = a * V / N + b`` through the smallest and largest N."""
    lo, hi = rows[0], rows[-1]
    if lo["n"] == hi["n"]:      # one size measured: no replicated part can be told apart
        return lo["saved_bytes"] / (lo["video_tokens"] / lo["n"]), 0.0
    x_lo, x_hi = lo["video_tokens"] / lo["n"], hi["video_tokens"] / hi["n"]
    a = (lo["saved_bytes"] - hi["saved_bytes"]) / (x_lo - x_hi)
    return a, lo["saved_bytes"] - a * x_lo


def render(rows: list[dict[str, Any]], shape: dict[str, int], args: argparse.Namespace) -> str:
    base = rows[0]["saved_bytes"] * rows[0]["n"]
    lines = [f"STDiT depth {shape['depth']}, hidden {shape['hidden']}, {shape['frames']} frames x "
             f"{(shape['size'] // 2) ** 2} tokens = {rows[0]['video_tokens']} video tokens, "
             f"{shape['text_len']} text tokens (replicated), fp32, batch 1; saved activations of one forward.", "",
             "| N | video tokens per rank | saved MiB per rank | of one process | ideal 1/N |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['video_tokens'] // r['n']} | {r['saved_bytes'] / 2**20:.2f} | "
                     f"{r['saved_bytes'] / base:.3f} | {1 / r['n']:.3f} |")
    a, b = fit(rows)
    depth, hidden = MODELS[args.model]
    scale = depth * hidden / (shape["depth"] * shape["hidden"]) * args.bytes / 4
    b_model = b * scale * args.text_len_model / shape["text_len"]
    budget = args.memory_gib * 2**30
    lines += ["", f"Fit: {a:.0f} bytes per video token on a rank, {b / 2**20:.2f} MiB replicated. "
              f"Scaled to {args.model} ({depth} layers, hidden {hidden}, {args.bytes} bytes per element, "
              f"{args.text_len_model} text tokens): {a * scale / 2**10:.0f} KiB per video token. "
              f"Longest video whose saved activations fit in {args.memory_gib:g} GiB per GPU (prediction; "
              "weights, gradients, optimizer state and workspace come on top):", "",
              "| N | video tokens | frames at 512x512 (1024 tokens each) |", "|---|---|---|"]
    for n in args.predict_n:
        tokens = max(0.0, (budget - b_model) * n / (a * scale))
        lines.append(f"| {n} | {tokens:,.0f} | {tokens / TOKENS_PER_FRAME_512PX:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4], help="DSP sizes to measure (default 1 2 4)")
    p.add_argument("--frames", type=int, default=16, help="latent frames (at least the largest --nproc; default 16)")
    p.add_argument("--size", type=int, default=32, help="latent height = width (patch 2: size^2/4 tokens a frame)")
    p.add_argument("--text-len", type=int, default=120, help="text tokens (T5 in OpenSora and Latte: 120)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the measured STDiT (default 64)")
    p.add_argument("--depth", type=int, default=2, help="layers of the measured STDiT (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads of the measured STDiT (default 4)")
    p.add_argument("--model", choices=sorted(MODELS), default="720M", help="model for the prediction")
    p.add_argument("--text-len-model", type=int, default=120, help="text tokens for the prediction (default 120)")
    p.add_argument("--bytes", type=int, default=2, help="bytes per element for the prediction (bf16: 2)")
    p.add_argument("--memory-gib", type=float, default=80.0, help="activation budget per GPU (default 80)")
    p.add_argument("--predict-n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="DSP sizes of the prediction (default 1 2 4 8 16 32)")
    args = p.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("frames", "size", "text_len", "hidden", "depth", "heads")}
    if sorted(args.nproc) != args.nproc:
        p.error(f"--nproc {args.nproc}: give the sizes in increasing order")
    largest, patches = max(args.nproc), (args.size // 2) ** 2     # before the first (minutes-long) measurement
    if args.frames < largest or patches < largest:
        p.error(f"--frames {args.frames} and --size {args.size} ({patches} patches a frame) leave a rank of "
                f"--nproc {largest} with no frame or patch; expected --frames >= {largest} and "
                f"(--size // 2)**2 >= {largest}, or a smaller --nproc")
    text = render(measure(args.nproc, shape), shape, args)
    print(text)
    return text


if __name__ == "__main__":
    main()
