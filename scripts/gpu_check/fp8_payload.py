"""The FP8 wire's own cost on the device (issue 28): encoding and decoding a switch's send buffer.

``comm_dtype="fp8"`` halves a bf16 switch's bytes; what it adds is ``dsp_plugin.comm.payload.encode`` (per
chunk: amax, scale, cast to e4m3, pack with the float32 scale) before the all-to-all and ``decode`` after.
This times both, eager and under ``torch.compile`` (Inductor fuses the cast), on the bench's switch shard
(``dsp_plugin.bench.switch.WIRE``: bf16 [2, 4, 256, 1024], 4 MiB, in N chunks for N ranks), beside the
bf16 path's own pack (a contiguous copy of the same bytes). One process, no collective: the wire time it
saves depends on the interconnect (bytes per switch: ``python -m dsp_plugin.bench --costs``).

    python scripts/gpu_check/fp8_payload.py            # cuda:0; SKIP without CUDA
    python scripts/gpu_check/fp8_payload.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402


def _median_us(fn, device: torch.device, reps: int = 50) -> float:  # noqa: ANN001
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        skip("no CUDA device")
    from dsp_plugin.bench.switch import WIRE
    from dsp_plugin.comm import payload

    device = torch.device(args.device)
    x = torch.randn(*WIRE, device=device, dtype=torch.bfloat16)
    fmt = torch.float8_e4m3fn
    print(f"| N | chunk MiB | bf16 pack us | FP8 encode us | FP8 decode us | encode compiled us | decode compiled us "
          f"| max rel err |\n|{' --- |' * 8}")
    ok = True
    for n in args.nproc:
        rows = [[c] for c in torch.tensor_split(x, n, dim=2)]
        shapes = [[tuple(c.shape)] for c in torch.tensor_split(x, n, dim=2)]
        send, _ = payload.encode(rows, [fmt])
        enc = torch.compile(lambda: payload.encode(rows, [fmt])[0])
        dec = torch.compile(lambda: payload.decode(send, shapes, [fmt], torch.bfloat16))
        got = torch.cat([c[0] for c in payload.decode(send, shapes, [fmt], torch.bfloat16)], dim=2)
        err = ((got.float() - x.float()).abs().max() / x.float().abs().max()).item()
        ok &= err < 0.07 and torch.equal(enc().view(torch.uint8), send)
        times = [_median_us(f, device) for f in (
            lambda: torch.cat([r[0].contiguous().reshape(-1) for r in rows]),
            lambda: payload.encode(rows, [fmt]),
            lambda: payload.decode(send, shapes, [fmt], torch.bfloat16), enc, dec)]
        print(f"| {n} | {x.numel() * 2 / n / 2**20:.2f} | " + " | ".join(f"{t:.0f}" for t in times) + f" | {err:.3f} |")
    finish(ok, f"FP8 encode/decode on {device}: round trip within e4m3's 2^-4 of each chunk's amax, compiled "
               f"encode bitwise equal to eager's")


if __name__ == "__main__":
    main()
