"""Sampling on the GPU: the Latte launch's ``sample()`` and ``dsp-sample --model tiny-wan`` on CUDA equal the CPU.

One process (a one-GPU machine), the launches' tiny random-weight pipelines and seeds,
frames compared with the CPU run's; the figure is the per-step latency on the GPU
and the largest difference (cuDNN's convolutions in the VAE use TF32 by default:
differences of ~1e-3 are expected, a wrong placement or dtype gives far more).
Wan runs as a user launches it, ``torchrun --nproc-per-node 1 -m dsp_plugin.launch.sample``
(NCCL on ``cuda:0``), against the plain ``WanPipeline`` on the CPU.

    python scripts/gpu_check/sampling.py
    python scripts/gpu_check/sampling.py --device cpu    # both runs on the CPU (equal: a reduced form)
"""

from __future__ import annotations

import argparse
import os
import subprocess
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


def wan_difference(device: torch.device, tmp: str) -> float:
    """max |frames of dsp-sample tiny-wan on ``device`` - the plain WanPipeline's on the CPU|."""
    from dsp_plugin.testing.tiny import tiny_wan_pipeline
    from tests.test_sample_command import WAN

    out = os.path.join(tmp, "wan.pt")
    env = {k: v for k, v in os.environ.items() if k != "DSP_BACKEND"}
    if device.type == "cpu":
        env["DSP_BACKEND"] = "gloo"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           "-m", "dsp_plugin.launch.sample", "--model", "tiny-wan", "--output", out],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        finish(False, f"dsp-sample --model tiny-wan on {device} exited with {proc.returncode}")
    pipe = tiny_wan_pipeline(layers=2)
    pipe.set_progress_bar_config(disable=True)
    want = torch.from_numpy(pipe(**WAN, generator=torch.Generator().manual_seed(0), output_type="np").frames)
    got = torch.load(out, weights_only=True)
    if got.shape != want.shape:
        finish(False, f"tiny-wan frames {tuple(got.shape)} on {device}, expected {tuple(want.shape)}")
    return (got.float() - want.float()).abs().max().item()


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
        wan_err = wan_difference(device, tmp)
    err = (here.float() - cpu.float()).abs().max().item()
    ok = here.shape == cpu.shape and bool(torch.isfinite(here).all()) and max(err, wan_err) <= TOLERANCE
    finish(ok, f"Latte {tuple(here.shape)} on {device}: max |{device.type} - cpu| = {err:.1e}, tiny Wan through "
               f"dsp-sample {wan_err:.1e} (<= {TOLERANCE}), Latte's median step {timings['step_ms_median']:.1f} ms")


if __name__ == "__main__":
    main()
