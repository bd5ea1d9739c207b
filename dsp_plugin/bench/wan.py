"""The full-3D row: Wan through ``dsp_plugin.parallelize`` against diffusers' own Ulysses, on N CPU ranks.

    python -m dsp_plugin.bench.wan --nproc 2 [--quick]

Measured here (gloo, CPU): our plan's forward against the unmodified model on
one process (max |difference|), its all-to-alls and bytes per layer
(``CommAccounting``), and the median forward time of both.

diffusers' ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))`` cannot
run on a CPU-only host: ``ModelMixin._resolve_parallel_config`` (diffusers
0.42.1, modeling_utils.py:1719) places each rank on
``rank % torch.accelerator.device_count()``, a modulo by zero without an
accelerator. So its row is by formula, from its code: ``TemplatedUlyssesAttention``
sends q, k and v with one ``all_to_all_single`` each and the output with a
fourth (attention_dispatch.py:2570, 2597); the bytes are the same as ours
(every rank sends (N-1)/N of its q, k, v and output), the calls 4 per layer
against our 2 (one packed q/k/v, one output). Both gather the output once.
Per rank the bytes differ when the frames do not divide by N: Wan's plan shards
whole frames of tokens (so sampling can keep the latents sharded on frames),
diffusers' plan cuts the flat token sequence evenly; 5 frames on 4 ranks give
rank 0 two frames (128 of 320 tokens) against diffusers' 80.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["main", "wan_row"]


def _setup(quick: bool) -> tuple[Any, tuple[torch.Tensor, ...]]:
    from dsp_plugin.adapters.tiny import tiny_wan

    layers, heads, size = (2, 3, 6) if quick else (4, 12, 16)
    model = tiny_wan(layers=layers, heads=heads, head_dim=8)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(1, 4, 5, size, size, generator=g), torch.tensor([500]),
             torch.randn(1, 7, 16, generator=g))
    return model, batch


def _median_time(fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, n: int, quick: bool, steps: int) -> dict[str, Any]:
    import dsp_plugin
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())   # the whole world is the DSP group (group=None refuses without one)
    reference, batch = _setup(quick)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    layers = len(reference.blocks)
    with torch.no_grad():
        expected = reference(*batch, return_dict=False)[0]
        with CommAccounting(activations=False) as acct:
            out = model(*batch, return_dict=False)[0]
        ours = _median_time(lambda: model(*batch), steps)
        one = _median_time(lambda: reference(*batch), steps) if rank == 0 else 0.0
    heads, head_dim = reference.config.num_attention_heads, reference.config.attention_head_dim
    tokens = out.shape[2] * out.shape[3] * out.shape[4] // 4
    local = tokens // n + (1 if rank < tokens % n else 0)
    # diffusers' Ulysses by formula: q, k, v and the output, each (N-1)/N of this rank's [local, H*Dh] fp32
    # sent; its reshape into N head groups (attention_dispatch.py:2566) needs H % N == 0
    ulysses_bytes = 4 * local * heads * head_dim * 4 * (n - 1) // n if heads % n == 0 else None
    return {"max_diff": (out - expected).abs().max().item(), "layers": layers, "tokens": tokens,
            "heads": heads, "all_to_all": acct.count("all_to_all"), "all_gather": acct.count("all_gather"),
            "a2a_bytes_sent": acct.bytes_sent("all_to_all"), "ulysses_bytes_formula": None if ulysses_bytes is None else ulysses_bytes * layers,
            "ours_s": ours, "one_process_s": one}


def wan_row(n: int, *, quick: bool = False, steps: int = 10) -> dict[str, Any]:
    """Rank 0's figures, with the per-layer counts."""
    rows = spawn(_worker, n, quick, steps, timeout=600)
    row = rows[0]
    row["n"] = n
    row["all_to_all_per_layer"] = row["all_to_all"] / row["layers"]
    row["ulysses_all_to_all_per_layer"] = 4
    row["max_diff"] = max(r["max_diff"] for r in rows)
    return row


def markdown(row: dict[str, Any]) -> str:
    ulysses = row["ulysses_bytes_formula"]
    ulysses_bytes = (f"{ulysses // row['layers']} (formula)" if ulysses is not None
                     else f"cannot run: {row['heads']} heads on {row['n']} ranks (needs H % N == 0)")
    return "\n".join([
        f"Wan (diffusers WanTransformer3DModel), {row['layers']} layers, {row['heads']} heads, "
        f"{row['tokens']} tokens, N={row['n']} (gloo, CPU, fp32, forward)",
        "",
        "| method | all-to-alls per layer | all-to-all bytes sent per layer (rank 0) | exit all_gathers | "
        "max abs diff vs one process | forward s (median) |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| dsp_plugin.parallelize (head switch) | {row['all_to_all_per_layer']:g} | "
        f"{row['a2a_bytes_sent'] // row['layers']} | {row['all_gather']} | {row['max_diff']:.3g} | "
        f"{row['ours_s']:.4f} |",
        f"| diffusers enable_parallelism(ulysses_degree={row['n']}) | 4 (formula) | "
        f"{ulysses_bytes} | 1 (formula) | not runnable on CPU | "
        f"not runnable on CPU |",
        f"| unmodified model, one process | 0 | 0 | 0 | 0 | {row['one_process_s']:.4f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.wan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 heads, 45 tokens")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    print(markdown(wan_row(args.nproc, quick=args.quick, steps=args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
