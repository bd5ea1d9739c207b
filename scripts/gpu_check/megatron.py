"""megatron.training's ``pretrain()`` on the GPU, through ``launch/run_megatron.sh``, as a user launches it.

    python scripts/gpu_check/megatron.py te-fp8     # one NCCL rank: TE + FP8 + fused RoPE + full recompute
    python scripts/gpu_check/megatron.py distopt    # the same with the distributed optimizer, overlapped grad reduce
    python scripts/gpu_check/megatron.py dsp2       # DSP=2 on CUDA tensors: two one-process nodes over gloo, one GPU

``dsp2`` is what one GPU can run of DSP: NCCL refuses two ranks on one device, so the
two ranks (two "nodes" of one process each, both on ``cuda:0``) talk over gloo, on
CUDA tensors; its losses are compared with one rank's (DSP=1) on the same weights
(``--init-seed``). Without Transformer Engine, ``te-fp8`` is skipped and the others
run the local layers in bf16. The figure is the loss curve.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from scripts.gpu_check.report import finish, free_port, skip  # noqa: E402
from tests.megatron_launch import LOSS, RECOMPUTE  # noqa: E402

# docs/composition.md's FP8 geometry (TE's FP8 GEMMs want token counts that divide by 16)
GEOMETRY = {"FRAMES": "16", "HEIGHT": "8", "WIDTH": "8", "TEXT_LEN": "16", "ITERS": "4", "GBS": "2"}
ROPE = ["--position-embedding-type", "rope"]   # fused RoPE: Megatron's default (needs TE)
TOLERANCE = 5e-2     # relative, bf16/FP8 losses of DSP=2 against DSP=1


def launch(knobs: dict[str, str], extra: list[str], *, node_rank: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **GEOMETRY, **knobs}
    if node_rank is not None:
        env["NODE_RANK"] = str(node_rank)
    return subprocess.Popen(["bash", os.path.join(ROOT, "launch/run_megatron.sh"), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(procs: list[subprocess.Popen]) -> dict[int, float]:
    outputs = [p.communicate(timeout=540)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            print(out[-6000:])
            finish(False, f"run_megatron.sh exited with {p.returncode}")
    found = {int(m.group(1)): float(m.group(2)) for out in outputs for m in LOSS.finditer(out)}
    if not found:
        print(outputs[0][-3000:])
        finish(False, "no loss line in the launch's log")
    return found


def curve(values: dict[int, float]) -> str:
    return " ".join(f"{values[i]:.4f}" for i in sorted(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["te-fp8", "distopt", "dsp2"])
    case = parser.parse_args().case
    if not torch.cuda.is_available():
        skip("no CUDA device")
    te = importlib.util.find_spec("transformer_engine") is not None
    if case == "te-fp8" and not te:
        skip("transformer_engine is not installed")
    knobs = {"IMPL": "transformer_engine", "FP8": "hybrid"} if te else {"IMPL": "local"}
    extra = ROPE + ([] if te else ["--no-rope-fusion"]) + RECOMPUTE
    single = {"NPROC": "1", "DSP": "1", "MASTER_PORT": free_port(), **knobs}
    if case in ("te-fp8", "distopt"):
        more = ["--use-distributed-optimizer", "--overlap-grad-reduce"] if case == "distopt" else []
        got = losses([launch(single, extra + more)])
        ok = all(v == v and v < 1e4 for v in got.values())   # finite
        finish(ok, f"{knobs} {' '.join(extra + more)}: loss {curve(got)}")
    reference = losses([launch(single, extra)])
    nodes = {"NPROC": "1", "NNODES": "2", "DSP": "2", "MASTER_PORT": free_port(), **knobs}
    shim = os.path.join(ROOT, "scripts/gpu_check/gloo_cuda")     # gloo's coalesced all-reduce on CUDA (see there)
    nodes["PYTHONPATH"] = f"{shim}:{os.environ.get('PYTHONPATH', '')}"
    got = losses([launch(nodes, [*extra, "--distributed-backend", "gloo"], node_rank=r) for r in (0, 1)])
    worst = max(abs(got[i] - reference[i]) / max(abs(reference[i]), 1e-6) for i in reference if i in got)
    finish(set(got) == set(reference) and worst <= TOLERANCE,
           f"DSP=2 over gloo on one GPU {curve(got)} vs DSP=1 {curve(reference)}: max relative difference "
           f"{worst:.1e} (<= {TOLERANCE}; {knobs})")


if __name__ == "__main__":
    main()
