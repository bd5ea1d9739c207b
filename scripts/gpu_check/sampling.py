"""Sampling on the GPU: the Latte launch's ``sample()`` on CUDA equals the same run on the CPU.

One process (a one-GPU machine), the launch's tiny random-weight pipeline and seed,
frames compared with the CPU run's; the figure is the per-step latency on the GPU
and the largest difference (cuDNN's convolutions in the VAE use TF32 by default:
differences of ~1e-3 are expected, a wrong placement or dtype gives far more).

    python scripts/gpu_check/sampling.py
    python scripts/gpu_check/sampling.py --device cpu    # both runs on the CPU (equal: a reduced form)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402

TOLERANCE = 5e-2   # frames in [0, 1]


def frames_on(device: torch.device, out: str) -> tuple[torch.Tensor, dict[str, float]]:
    from dsp_plugin.launch import sample_latte

    args = sample_latte.parse_args(["--frames", "7", "--steps", "4", "--out", out])
    timings = sample_latte.sample(args, device)
    return torch.load(out, weights_only=True), timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default; SKIP without CUDA) or cpu")
    device = torch.device(parser.parse_args().device)
    if device.type == "cuda" and not torch.cuda.is_available():
        skip("no CUDA device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        here, timings = frames_on(device, os.path.join(tmp, "device.pt"))
        cpu, _ = frames_on(torch.device("cpu"), os.path.join(tmp, "cpu.pt"))
    err = (here.float() - cpu.float()).abs().max().item()
    ok = here.shape == cpu.shape and bool(torch.isfinite(here).all()) and err <= TOLERANCE
    finish(ok, f"Latte {tuple(here.shape)} on {device}: max |{device.type} - cpu| = {err:.1e} (<= {TOLERANCE}), "
               f"median step {timings['step_ms_median']:.1f} ms")


if __name__ == "__main__":
    main()
