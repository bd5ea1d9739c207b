"""``dsp-sample``: sample a video with a diffusers pipeline on N processes, the latents sharded over DSP.

    torchrun --nproc-per-node 2 -m dsp_plugin.launch.sample --model tiny-wan --output out/v.mp4
    torchrun --nproc-per-node 2 -m dsp_plugin.launch.sample --model tiny-wan --vae-tiling --output out/v.mp4
    dsp-sample --model tiny-wan --dsp 2 --cfg-parallel --output out/v.gif     # spawns 4 processes itself
    dsp-sample --model /path/to/WanPipeline --prompt "a cat walks on the grass" --num-frames 81 --output v.mp4
    dsp-sample --model /path/to/LTX2Pipeline --dsp 2 --height 512 --width 768 --num-frames 121 --output v.mp4

``--model`` is a built-in tiny model (``tiny-wan``, ``tiny-latte``: random weights, nothing downloaded)
or a local directory written by diffusers' ``save_pretrained`` (a ``WanPipeline`` or ``LattePipeline``, the
latents sharded on frames; or an ``LTX2Pipeline``, ``HunyuanVideo15Pipeline``, ``WanVACEPipeline`` or
``Kandinsky5T2VPipeline``, the latents whole, the transformer split by its built-in plan: ``parallelize_pipeline``),
loaded with ``from_pretrained``, local files only. ``--call-args FILE.pt``: more ``__call__`` arguments
(``torch.save`` of a dict, e.g. precomputed prompt embeddings for a pipeline saved without its text encoder). The pipeline's own ``__call__`` runs
(``dsp_plugin.pipelines``): its progress bar shows on rank 0, every rank ends with the video, and rank 0
writes each ``--output`` with diffusers' exporters (``.mp4``: ``export_to_video``; ``.gif``:
``export_to_gif``; ``.pt``: ``torch.save`` of the float frames ``[B, T, H, W, 3]`` in [0, 1]).
Under torchrun the world is ``--dsp`` x (2 with ``--cfg-parallel``); without torchrun ``dsp-sample``
starts that many processes itself. NCCL and one GPU per process when CUDA is present, gloo on the CPU
otherwise (``dsp_plugin.backend``; ``DSP_BACKEND=gloo`` forces the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

BUILTIN = ("tiny-wan", "tiny-latte")
OUTPUTS = (".mp4", ".gif", ".pt")
DTYPES = ("float32", "bfloat16", "float16")
PROG = "dsp-sample"
#: a pipeline directory's default video (Wan's published size; Latte: its transformer's video_length if it says)
DIRECTORY_FRAMES, DIRECTORY_HEIGHT, DIRECTORY_WIDTH = {"wan": 81, "latte": 16}, 480, 832
#: --vae-tiling on tiny-wan: diffusers' default tiles (256 pixels) exceed its 16x16 video; these make 2x2 tiles there
TINY_WAN_TILES = {"tile_sample_min_height": 12, "tile_sample_min_width": 12, "tile_sample_stride_height": 8,
                  "tile_sample_stride_width": 8}


def build_parser() -> argparse.ArgumentParser:
    from dsp_plugin import __version__

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s (dsp_plugin) {__version__}")
    p.add_argument("--model", default="tiny-wan", metavar="{tiny-wan,tiny-latte,DIR}",
                   help="a built-in tiny model or a save_pretrained directory of a WanPipeline or LattePipeline "
                        "(default tiny-wan)")
    p.add_argument("--prompt", default="a cat walks on the grass", help="the text prompt")
    p.add_argument("--negative-prompt", default="blurry", help="the negative prompt (classifier-free guidance)")
    p.add_argument("--num-frames", type=int, default=None,
                   help="video frames (default: tiny-wan 9, tiny-latte 7, a pipeline directory 81 for Wan, "
                        "its transformer's video_length for Latte)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: 16 for the tiny models, else 480)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: 16 for the tiny models, else 832)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default 4)")
    p.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale, 1 = off (default 4)")
    p.add_argument("--dsp", type=int, default=None,
                   help="DSP ranks: the latents' frames are split over them (default: the torchrun world, "
                        "halved with --cfg-parallel; 1 without torchrun)")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="run the conditional and unconditional halves on a 2-way axis (world = 2 x --dsp)")
    p.add_argument("--vae-tiling", action="store_true",
                   help="Wan: decode in spatial tiles (vae.enable_tiling; diffusers' default tiles of 256 pixels "
                        "at stride 192, tiny-wan 12 at stride 8), each DSP rank decoding its share of the tiles "
                        "(default off: every rank decodes the whole video)")
    p.add_argument("--output", action="append", default=[], metavar="FILE{.mp4,.gif,.pt}",
                   help="written by rank 0; repeat for several (e.g. --output v.mp4 --output v.pt)")
    p.add_argument("--fps", type=int, default=8, help="frames per second of .mp4 and .gif (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise generator (the same on every rank)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the pipeline's dtype (default float32)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="text tokens (Wan; default 16 for tiny-wan, else 512)")
    p.add_argument("--call-args", default=None, metavar="FILE.pt",
                   help="a torch.save'd dict of more arguments for the pipeline's __call__ (e.g. prompt_embeds for a "
                        "pipeline saved without its text encoder); they override the command's own")
    p.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="rank 0 writes the pipeline here (save_pretrained) before sampling")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective may wait for a peer before every rank stops (default 300)")
    return p


def fail(message: str) -> None:
    """An argument error: one line, naming the fix; nothing has been started."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_args(args: argparse.Namespace, torchrun_world: int | None) -> int:
    """Every argument error, before a process is started or a model built; returns the world size."""
    import importlib.util

    from dsp_plugin.paths import OutputPathError, check_output_dir, check_output_file

    for module in ("diffusers", "transformers"):
        if importlib.util.find_spec(module) is None:
            fail(f"{module} is not installed; install the extra: pip install 'dsp_plugin[diffusers]'")
    if args.model not in BUILTIN and not (Path(args.model) / "model_index.json").is_file():
        fail(f"--model {args.model}: expected one of {', '.join(BUILTIN)} or a directory with model_index.json "
             f"(written by diffusers' save_pretrained)")
    for name in ("steps", "fps", "num_frames", "height", "width", "max_sequence_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    if not 0 < args.timeout < float("inf"):  # 0 would fail the rendezvous itself ("timed out after 0ms")
        fail(f"--timeout {args.timeout:g}: expected a positive number of seconds (how long a collective may wait "
             f"for a peer)")
    for out in args.output:
        if Path(out).suffix not in OUTPUTS:
            fail(f"--output {out}: expected a file ending in {', '.join(OUTPUTS)}")
        if Path(out).suffix == ".mp4" and (importlib.util.find_spec("imageio") is None
                                           or importlib.util.find_spec("imageio_ffmpeg") is None):
            fail(f"--output {out}: writing .mp4 needs imageio and imageio-ffmpeg; install the extra: "
                 f"pip install 'dsp_plugin[diffusers]'")
        try:     # writable (its directory created), not a directory: before the work (dsp_plugin.paths)
            check_output_file("--output", out)
        except OutputPathError as exc:
            fail(str(exc))
    if args.call_args is not None and not Path(args.call_args).is_file():
        fail(f"--call-args {args.call_args}: no such file; expected a torch.save'd dict of __call__ arguments")
    if args.save_pretrained:
        try:
            check_output_dir("--save-pretrained", args.save_pretrained)
        except OutputPathError as exc:
            fail(str(exc))
    if args.vae_tiling and args.model == "tiny-latte":
        fail("--vae-tiling with --model tiny-latte: the tiles are Wan's (AutoencoderKLWan); Latte's VAE already "
             "decodes each rank's frames; expected a Wan model, or no --vae-tiling")
    if args.cfg_parallel and args.guidance <= 1.0:
        fail(f"--cfg-parallel with --guidance {args.guidance}: guidance <= 1 turns classifier-free guidance off; "
             f"expected --guidance > 1, or no --cfg-parallel")
    cfg = 2 if args.cfg_parallel else 1
    if args.dsp is not None and args.dsp < 1:
        fail(f"--dsp {args.dsp}: expected a positive integer")
    if torchrun_world is not None:
        if torchrun_world % cfg:
            fail(f"--cfg-parallel on {torchrun_world} processes: expected an even --nproc-per-node")
        if args.dsp is not None and args.dsp * cfg != torchrun_world:
            fail(f"--dsp {args.dsp}{' x 2 (--cfg-parallel)' if cfg == 2 else ''} != the torchrun world "
                 f"{torchrun_world}; expected --nproc-per-node {args.dsp * cfg} or --dsp {torchrun_world // cfg}")
        world = torchrun_world
    else:
        world = (args.dsp or 1) * cfg
    dsp = world // cfg
    if args.model not in BUILTIN:  # the saved pipeline's configs say what sizes it takes (no weight loaded)
        from dsp_plugin.launch.pipeline_sizes import check_pipeline_sizes, latte_video_length, pipeline_kind

        kind = pipeline_kind(args.model)
        if kind == "pipeline" and (args.cfg_parallel or args.vae_tiling):
            fail(f"--model {args.model}: {'--cfg-parallel' if args.cfg_parallel else '--vae-tiling'} is for the "
                 f"frame-sharded Wan and Latte samplers; this pipeline runs whole latents through its transformer's "
                 f"plan (parallelize_pipeline); expected neither flag")
        if kind == "latte" and args.num_frames is None:  # the frames its temporal position table holds
            args.num_frames = latte_video_length(args.model)
        defaults = tuple(f for f, v in (("num-frames", args.num_frames), ("height", args.height),
                                        ("width", args.width)) if v is None)
        try:
            check_pipeline_sizes(args.model, frames=args.num_frames or DIRECTORY_FRAMES.get(kind or "wan", 81),
                                 height=args.height or DIRECTORY_HEIGHT, width=args.width or DIRECTORY_WIDTH,
                                 dsp=dsp, defaults=defaults)
        except ValueError as exc:
            fail(str(exc))
    if args.model in BUILTIN:
        frames = args.num_frames or (9 if args.model == "tiny-wan" else 7)
        latent = (frames - 1) // 2 + 1 if args.model == "tiny-wan" else frames
        if latent < dsp:
            need = 2 * dsp - 1 if args.model == "tiny-wan" else dsp
            fail(f"--num-frames {frames} gives {latent} latent frames, fewer than --dsp {dsp}; expected "
                 f"--num-frames >= {need}")
        for name in ("height", "width"):
            value = getattr(args, name)
            if value is not None and value % 16:
                fail(f"--{name} {value}: the tiny models need a multiple of 16")
    return world


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    torchrun_world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else None
    world = check_args(args, torchrun_world)
    if torchrun_world is not None:
        return [_torchrun(args)]
    if world == 1:
        return [sample(args)]
    from dsp_plugin.spawn import spawn

    return spawn("dsp_plugin.launch.sample:_spawned", world, vars(args), timeout=24 * 3600,
                 collective_timeout_s=args.timeout, backend="auto")


def _torchrun(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from dsp_plugin import backend as runtime
    from dsp_plugin.topology import set_topology

    runtime.init_distributed(timeout_s=args.timeout)
    try:
        return sample(args)
    finally:
        set_topology(None)
        dist.destroy_process_group()


def _spawned(rank: int, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    return sample(argparse.Namespace(**arguments))


def load(args: argparse.Namespace) -> tuple[Any, str]:
    """The pipeline and its kind (``"wan"`` or ``"latte"``)."""
    import torch

    dtype = getattr(torch, args.dtype)
    if args.model == "tiny-wan":
        from dsp_plugin.testing.tiny import tiny_wan_pipeline

        pipe = tiny_wan_pipeline(layers=2, seed=args.seed)
        return (pipe if dtype is torch.float32 else pipe.to(dtype=dtype)), "wan"
    if args.model == "tiny-latte":
        from dsp_plugin.testing.tiny import tiny_latte_pipeline

        pipe = tiny_latte_pipeline(frames=args.num_frames or 7, sample_size=(args.height or 16) // 2, seed=args.seed)
        return (pipe if dtype is torch.float32 else pipe.to(dtype=dtype)), "latte"
    from diffusers import DiffusionPipeline, LattePipeline, WanPipeline

    from dsp_plugin.launch.pipeline_sizes import PLANNED_PIPELINES, saved_without

    pipe = DiffusionPipeline.from_pretrained(args.model, local_files_only=True, torch_dtype=dtype,
                                             **dict.fromkeys(saved_without(args.model)))
    if type(pipe).__name__ in PLANNED_PIPELINES:
        return pipe, "pipeline"
    kinds = {WanPipeline: "wan", LattePipeline: "latte"}
    kind = next((k for cls, k in kinds.items() if isinstance(pipe, cls)), None)
    if kind is None:
        raise ValueError(f"{PROG}: --model {args.model} holds a {type(pipe).__name__}; expected a WanPipeline, "
                         f"a LattePipeline or one of {', '.join(PLANNED_PIPELINES)}")
    return pipe, kind


def call_arguments(args: argparse.Namespace, kind: str, pipe: Any, device: Any) -> dict[str, Any]:
    """The pipeline's ``__call__`` arguments for this command line."""
    import torch

    tiny = args.model in BUILTIN
    common = {"height": args.height or (16 if tiny else DIRECTORY_HEIGHT),
              "width": args.width or (16 if tiny else DIRECTORY_WIDTH),
              "num_inference_steps": args.steps, "guidance_scale": args.guidance, "output_type": "np",
              "generator": torch.Generator().manual_seed(args.seed)}
    if kind == "pipeline":
        return _pipeline_call(args, pipe, common)
    if kind == "wan":
        return {**common, "prompt": args.prompt, "negative_prompt": args.negative_prompt,
                "num_frames": args.num_frames or (9 if tiny else DIRECTORY_FRAMES["wan"]),
                "max_sequence_length": args.max_sequence_length or (16 if tiny else 512)}
    frames = args.num_frames or (7 if tiny else DIRECTORY_FRAMES["latte"])
    if pipe.text_encoder is None:       # the tiny Latte has no T5: seeded stand-ins for its embeddings
        from dsp_plugin.log import get_logger
        from dsp_plugin.testing.tiny import tiny_prompt_embeds

        get_logger(__name__).info("%s: the pipeline has no text encoder; random prompt embeddings (--seed %d) "
                                  "stand in for --prompt", PROG, args.seed)
        prompt, negative = (t.to(device, pipe.transformer.dtype) for t in tiny_prompt_embeds(seed=args.seed))
        return {**common, "prompt_embeds": prompt, "negative_prompt": None, "negative_prompt_embeds": negative,
                "video_length": frames}
    return {**common, "prompt": args.prompt, "negative_prompt": args.negative_prompt, "video_length": frames}


def _pipeline_call(args: argparse.Namespace, pipe: Any, common: dict[str, Any]) -> dict[str, Any]:
    """A ``parallelize_pipeline`` pipeline's arguments: those its ``__call__`` takes (HunyuanVideo 1.5 takes its
    guidance from its guider), the prompt when it has a text encoder, then ``--call-args``'s."""
    import inspect

    import torch

    takes = inspect.signature(type(pipe).__call__).parameters
    call = {**common, "num_frames": args.num_frames or DIRECTORY_FRAMES["wan"]}
    if getattr(pipe, "text_encoder", None) is not None:
        call.update(prompt=args.prompt, negative_prompt=args.negative_prompt)
    if args.max_sequence_length is not None:
        call["max_sequence_length"] = args.max_sequence_length
    call = {k: v for k, v in call.items() if k in takes}
    if args.call_args is not None:
        call.update(torch.load(args.call_args, weights_only=True))
    return call


def sample(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dsp_plugin import backend as runtime
    from dsp_plugin.log import get_logger, quiet_third_party, setup
    from dsp_plugin.pipelines import (
        parallelize_latte_pipeline,
        parallelize_pipeline,
        parallelize_wan_pipeline,
        sampling_groups,
    )

    setup()
    quiet_third_party()
    log = get_logger(__name__)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = runtime.current_device() if dist.is_initialized() else runtime.choose().device
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    pipe, kind = load(args)
    pipe = pipe.to(device)
    if args.vae_tiling:
        if kind != "wan":
            raise ValueError(f"{PROG}: --vae-tiling tiles Wan's VAE (AutoencoderKLWan); --model {args.model} holds "
                             f"a {type(pipe).__name__}; expected a WanPipeline, or no --vae-tiling")
        pipe.vae.enable_tiling(**(TINY_WAN_TILES if args.model == "tiny-wan" else {}))
    if args.save_pretrained and rank == 0:
        pipe.save_pretrained(args.save_pretrained)
    dsp_group, cfg_group = sampling_groups(cfg_parallel=args.cfg_parallel)
    if kind == "pipeline":
        sampler: Any = parallelize_pipeline(pipe, dsp_group=dsp_group)
    else:
        parallelize = parallelize_wan_pipeline if kind == "wan" else parallelize_latte_pipeline
        sampler = parallelize(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    call = call_arguments(args, kind, pipe, device)
    start = time.perf_counter()
    result = sampler(**call)
    frames = result.frames                           # [B, T, H, W, 3], float in [0, 1], on every rank
    audio = getattr(result, "audio", None)             # LTX-2: the waveform [B, channels, samples]
    seconds = time.perf_counter() - start
    layout = f"cfg(2) x dsp({world // 2})" if args.cfg_parallel else f"dsp({world})"
    if args.vae_tiling:
        vae = pipe.vae
        layout += (f", VAE tiles {vae.tile_sample_min_height}x{vae.tile_sample_min_width} at stride "
                   f"{vae.tile_sample_stride_height}x{vae.tile_sample_stride_width}")
    log.info("%s: %s, %d process(es): %s, %d frames %dx%d, %d steps, on %s: %.2f s", PROG, args.model, world,
             layout, frames.shape[1], frames.shape[2], frames.shape[3], args.steps, device.type, seconds)
    if rank == 0:
        for out in args.output:
            write(frames, out, args.fps)
            log.info("%s: wrote %s", PROG, out)
            if audio is not None and out.endswith(".pt"):
                torch.save(torch.as_tensor(audio), out[:-3] + ".audio.pt")
                log.info("%s: wrote %s", PROG, out[:-3] + ".audio.pt")
    return {"rank": rank, "world": world, "seconds": seconds, "shape": tuple(frames.shape)}


def write(frames: Any, path: str, fps: int) -> None:
    """The first video of ``frames`` ``[B, T, H, W, 3]`` to ``path`` with diffusers' exporters (``.pt``: all)."""
    import torch

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    suffix = Path(path).suffix
    if suffix == ".pt":
        torch.save(torch.from_numpy(frames), path)
    elif suffix == ".mp4":
        from diffusers.utils import export_to_video

        export_to_video(list(frames[0]), path, fps=fps)
    else:
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.utils import export_to_gif

        export_to_gif(VaeImageProcessor.numpy_to_pil(frames[0]), path, fps=fps)


if __name__ == "__main__":
    main()
