"""Per-step latency and bytes of sampling diffusers' LattePipeline on N processes (for a video: ``dsp-sample``).

    torchrun --nproc-per-node 4 -m dsp_plugin.launch.sample_latte --frames 7 --steps 4 --cfg-parallel --out video.pt

Builds a tiny random-weight pipeline (nothing is downloaded) or loads a local
one (``--pretrained DIR``, diffusers' ``from_pretrained``), samples with
``parallelize_latte_pipeline``, prints per-step latency and the bytes this rank
communicated (``CommAccounting``), and writes the frames to ``--out`` on rank 0
(``torch.save`` of a ``[B, T, 3, H, W]`` float tensor). ``--save-pretrained DIR``
writes the pipeline first (to make a checkpoint for ``--pretrained``).
Without torchrun it runs on one process. NCCL and one GPU per process when CUDA is
present, gloo on the CPU otherwise (``dsp_plugin.backend``; ``DSP_BACKEND=gloo``
forces the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dsp_plugin import backend as runtime
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.failures import launch_main, reporting
from dsp_plugin.log import setup
from dsp_plugin.paths import OutputPathError, check_output_dir, check_output_file, raise_on_every_rank
from dsp_plugin.pipelines import parallelize_latte_pipeline, sampling_groups
from dsp_plugin.testing.tiny import tiny_latte_pipeline, tiny_prompt_embeds
from dsp_plugin.topology import set_topology


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=7, help="video length (latent frames)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps")
    p.add_argument("--size", type=int, default=16, help="height = width in pixels")
    p.add_argument("--layers", type=int, default=2, help="transformer layers of the tiny model")
    p.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale (1 = off)")
    p.add_argument("--cfg-parallel", action="store_true", help="cond/uncond halves on a 2-way axis")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrained", default=None, help="local directory written by save_pretrained")
    p.add_argument("--save-pretrained", default=None, help="write the pipeline here (rank 0) before sampling")
    p.add_argument("--out", default=None, help="torch.save the frames here (rank 0)")
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a collective may wait for a peer before every rank stops (default 120)")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.endswith(".pt"):
        p.error(f"--out {args.out}: this command writes a torch.save file; expected a .pt path "
                f"(for a .mp4 or .gif: dsp-sample --model tiny-latte --output {args.out})")
    return args


@launch_main
def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    created = "RANK" in os.environ and not dist.is_initialized()
    try:
        if created:
            device = runtime.init_distributed(timeout_s=args.timeout).device
        else:
            device = runtime.current_device() if dist.is_initialized() else runtime.choose().device
        with reporting():   # this rank's own error posted for its peers, a peer's named (dsp_plugin.failures)
            return sample(args, device)
    finally:  # also on an error: no gloo work left for interpreter exit, no topology left installed
        set_topology(None)
        if created and dist.is_initialized():
            dist.destroy_process_group()


def check_outputs(args: argparse.Namespace, rank: int) -> None:
    """Rank 0 writes ``--out`` and ``--save-pretrained``: it checks them before sampling, and its verdict
    stops every rank alike (``paths.raise_on_every_rank``), not rank 0 alone after the frames are made."""
    error: Exception | None = None
    if rank == 0:
        try:
            if args.out:
                check_output_file("--out", args.out)
            if args.save_pretrained:
                check_output_dir("--save-pretrained", args.save_pretrained)
        except OutputPathError as exc:
            error = exc
    raise_on_every_rank("dsp_plugin.launch.sample_latte", error)


def sample(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_outputs(args, rank)
    torch.set_num_threads(1)
    pipe = tiny_latte_pipeline(frames=args.frames, layers=args.layers, sample_size=args.size // 2,
                               seed=args.seed, pretrained=args.pretrained).to(device)
    pipe.set_progress_bar_config(disable=True)
    if args.save_pretrained and rank == 0:
        pipe.save_pretrained(args.save_pretrained)
    dsp_group, cfg_group = sampling_groups(cfg_parallel=args.cfg_parallel)
    sampler = parallelize_latte_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    prompt, negative = (t.to(device) for t in tiny_prompt_embeds(seed=args.seed))

    marks: list[tuple[float, int]] = []
    with CommAccounting(activations=False) as acct:
        def on_step(pipe: object, i: int, t: object, kwargs: dict) -> dict:
            runtime.synchronize(device)
            marks.append((time.perf_counter(), sum(r.bytes_sent for r in acct.records)))
            return {}

        marks.append((time.perf_counter(), 0))
        frames = sampler(prompt_embeds=prompt, negative_prompt=None, negative_prompt_embeds=negative,
                         video_length=args.frames, height=args.size, width=args.size,
                         num_inference_steps=args.steps, guidance_scale=args.guidance,
                         generator=torch.Generator().manual_seed(args.seed), output_type="pt",
                         callback_on_step_end=on_step).frames
        runtime.synchronize(device)
        end = time.perf_counter()
    step_s = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    step_bytes = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    final_bytes = sum(r.bytes_sent for r in acct.records) - marks[-1][1]
    stats = {"world": world, "step_ms_median": 1e3 * statistics.median(step_s),
             "step_bytes": step_bytes[-1], "final_bytes": final_bytes,
             "total_s": end - marks[0][0]}
    log = setup(stream="stdout").info       # the dsp_plugin logger: rank 0 only (dsp_plugin.log)
    cfg = "cfg(2) x " if args.cfg_parallel else ""
    log(f"sample_latte: {world} process(es), {cfg}dsp({world // (2 if args.cfg_parallel else 1)}), "
        f"{args.frames} frames, {args.steps} steps, on {device}")
    for i, (s, b) in enumerate(zip(step_s, step_bytes)):
        log(f"  step {i}: {1e3 * s:8.2f} ms  {b:>9d} bytes sent by rank 0")
    log(f"  after the loop (decode + gather pixels): {final_bytes} bytes; total {stats['total_s']:.3f} s")
    if rank == 0 and args.out:
        torch.save(frames.contiguous().cpu(), args.out)
        log(f"  wrote {tuple(frames.shape)} to {args.out}")
    return stats


if __name__ == "__main__":
    main()
