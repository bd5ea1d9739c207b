"""DeepSpeed ZeRO-2/3 in fp16 and bf16 on CUDA, through ``launch/run_deepspeed.sh`` (one GPU: DSP=1).

    python scripts/gpu_check/deepspeed.py --zero 2 --precision fp16

DeepSpeed's engine, loss scaler (fp16) and ZeRO partitioning on CUDA tensors with
``dsp_plugin.deepspeed.initialize`` (the DSP key, size 1: one GPU cannot hold two
NCCL ranks, and DeepSpeed's CUDA accelerator talks NCCL only). The figure is the
loss curve; PASS when it is finite and its last value is below its first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from scripts.gpu_check.report import finish, free_port, skip  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero", type=int, choices=[2, 3], required=True)
    parser.add_argument("--precision", choices=["fp16", "bf16"], required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        skip("no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.json")
        env = {**os.environ, "PYTHON": sys.executable, "NPROC": "1", "DSP": "1", "ZERO": str(args.zero),
               "PRECISION": args.precision, "ITERS": str(args.steps), "LAUNCHER": "torchrun",
               "MASTER_PORT": free_port(),   # steps may run side by side on one machine
               "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
        proc = subprocess.run(["bash", os.path.join(ROOT, "launch/run_deepspeed.sh"), "--losses-json", out],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            finish(False, f"ZeRO-{args.zero} {args.precision}: run_deepspeed.sh exited with {proc.returncode}")
        losses = json.loads(open(out).read())
    ok = bool(losses) and all(v == v and abs(v) < 1e4 for v in losses) and losses[-1] < losses[0]
    finish(ok, f"ZeRO-{args.zero} {args.precision} on {torch.cuda.get_device_name()}: loss "
               f"{' '.join(f'{v:.4f}' for v in losses)}")


if __name__ == "__main__":
    main()
