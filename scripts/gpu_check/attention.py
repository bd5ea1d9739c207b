"""Attention kernels at the batch sizes DSP creates: folded rows past 65,535, an empty shard, a rank with no head.

DSP folds the dims a block does not attend along into the batch: a spatial block
on a ``[B, T/N, S, D]`` shard attends over ``B*T/N`` rows, a temporal one over
``B*S/N``, so the kernels see batches far larger than a language model's, and a
shard or a head range can be empty. CUDA's grid limits its y and z dims to
65,535, and fused kernels have broken past them before. Each backend of
``scaled_dot_product_attention`` that accepts the case (flash, memory-efficient,
cuDNN, math) and SDPA's default choice is compared with fp32 math on the same inputs; Transformer Engine's
``DotProductAttention`` too when it imports.

    python scripts/gpu_check/attention.py               # bf16 on cuda:0, 70,000 rows
    python scripts/gpu_check/attention.py --device cpu  # fp32, 600 rows (the test suite runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
            "default": None}                   # SDPA's own choice: what a model that names no backend gets


def cases(rows: int) -> dict[str, tuple[int, int, int, int]]:
    """[batch, heads, tokens, head dim] of each case (the layout SDPA takes)."""
    return {f"rows={rows}": (rows, 1, 8, 64), f"rows={rows} x 2 heads": (rows // 2 + 1, 2, 8, 64),
            "empty shard": (0, 2, 8, 64), "no head": (4, 0, 8, 64)}


def run(device: torch.device, dtype: torch.dtype, rows: int, tolerance: float,
        only: tuple[str, str] | None = None) -> tuple[list[str], int, int, int]:
    """Printed lines, kernel runs, runs off the reference (or failed), cases a backend's checks refused."""
    lines, runs, bad, refused = [], 0, 0, 0
    for index, (name, shape) in enumerate(cases(rows).items()):
        if only is not None and only[0] != name:
            continue
        g = torch.Generator(device=device).manual_seed(index)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for backend, kind in BACKENDS.items():
            if only is not None and only[1] != backend:
                continue
            try:
                with sdpa_kernel(kind) if kind is not None else contextlib.nullcontext():
                    got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            except RuntimeError as exc:
                if "No viable backend" in str(exc):   # SDPA's own checks refuse the case (dtype, shape, device)
                    refused += 1
                    lines.append(f"{name} {backend}: not taken by this backend")
                else:                                  # a kernel that accepted the case and failed
                    runs, bad = runs + 1, bad + 1
                    lines.append(f"FAIL {name} {backend}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            if not isinstance(got, torch.Tensor):     # seen on an H200 with torch 2.11: a backend returned None
                runs, bad = runs + 1, bad + 1
                lines.append(f"FAIL {name} {backend}: returned {type(got).__name__}, not a tensor")
                continue
            err = (got.float() - want).abs().max().item() if got.numel() else 0.0
            ok = got.shape == want.shape and err <= tolerance
            runs, bad = runs + 1, bad + (not ok)
            lines.append(f"{'' if ok else 'FAIL '}{name} {backend}: max error {err:.1e}, shape {tuple(got.shape)}")
    return lines, runs, bad, refused


def isolated(device: str, rows: int) -> tuple[list[str], int, int, int]:
    """``run`` with each (case, backend) in its own process: a kernel that kills its process (seen: SIGFPE on
    an H200 with torch 2.11) is one FAIL line naming it, and the other runs still report."""
    lines, runs, bad, refused = [], 0, 0, 0
    for name in cases(rows):
        for backend in BACKENDS:
            proc = subprocess.run([sys.executable, __file__, "--device", device, "--rows", str(rows),
                                   "--only", f"{name}/{backend}"], capture_output=True, text=True, timeout=120)
            if proc.returncode < 0:
                runs, bad = runs + 1, bad + 1
                lines.append(f"FAIL {name} {backend}: the process died with {signal.Signals(-proc.returncode).name}")
            elif proc.returncode not in (0, 1, 2):
                runs, bad = runs + 1, bad + 1
                lines.append(f"FAIL {name} {backend}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
            else:
                lines += proc.stdout.strip().splitlines()
                runs, bad, refused = runs + (proc.returncode != 2), bad + (proc.returncode == 1), \
                    refused + (proc.returncode == 2)
    return lines, runs, bad, refused


def run_te(device: torch.device, rows: int, tolerance: float) -> tuple[list[str], int, int, int]:
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return ["transformer_engine: not importable, its attention not checked"], 0, 0, 0
    attention = te.DotProductAttention(num_attention_heads=1, kv_channels=64, qkv_format="sbhd",
                                       attn_mask_type="no_mask")
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(8, rows, 1, 64, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    got = attention(q, k, v).float().view(8, rows, 1, 64)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.float().permute(1, 2, 0, 3) for t in (q, k, v)))
    err = (got - want.permute(2, 0, 1, 3)).abs().max().item()
    ok = err <= tolerance
    return [f"{'' if ok else 'FAIL '}TE DotProductAttention rows={rows}: max error {err:.1e}"], 1, int(not ok), 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default; SKIP without CUDA) or cpu")
    parser.add_argument("--rows", type=int, default=None, help="folded rows (default: 70,000 on CUDA, 600 on CPU)")
    parser.add_argument("--only", help="CASE/BACKEND: that kernel run alone (what isolated() starts)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        skip("no CUDA device")
    cuda = device.type == "cuda"
    rows = args.rows or (70_000 if cuda else 600)
    dtype, tolerance = (torch.bfloat16, 2e-2) if cuda else (torch.float32, 1e-5)
    if args.only:                             # one kernel run, in a child of isolated()
        lines, runs, bad, refused = run(device, dtype, rows, tolerance, only=tuple(args.only.split("/")))
        print("\n".join(lines))
        sys.exit(bad * 1 + refused * 2)
    lines, runs, bad, refused = isolated(args.device, rows) if cuda else run(device, dtype, rows, tolerance)
    if cuda:
        te = run_te(device, rows, tolerance)
        lines, runs, bad, refused = lines + te[0], runs + te[1], bad + te[2], refused + te[3]
    print("\n".join(lines))
    finish(runs > 0 and not bad, f"{runs - bad}/{runs} kernel runs within {tolerance} of fp32 math, {refused} cases "
                                 f"a backend does not take ({dtype}, {rows:,} rows, {device})")


if __name__ == "__main__":
    main()
