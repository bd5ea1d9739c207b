"""``python -m dsp_plugin.dryrun`` (``dsp-dryrun``): will the run fit, what does it send, how long is a step.

    python -m dsp_plugin.dryrun --model wan2.1-14b --frames 81 --height 720 --width 1280 \\
        --dsp 8 --zero 3 --recompute full
    python -m dsp_plugin.dryrun --model wan2.1-14b --zero 3 --recompute full --sweep dsp=1,2,4,8
    python -m dsp_plugin.dryrun --model stdit-720m --frames 128 --height 1024 --width 1024 --dsp 2 --json

Builds the real-size model from its published config without allocating it (fake tensors),
applies the DSP plan (or the Megatron layers), runs one training step as rank 0 of a fake
process group of ``tp x dsp x dp`` ranks, and prints per GPU: memory (parameters, gradients,
optimizer states, activations and the module holding their peak, communication buffers), the
step's collectives by block, its FLOPs and an estimated step time. ``dsp_plugin/dryrun/`` holds
the pieces; docs/scaling.md ("Will it fit") explains the table and what the dry run cannot see.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

__all__ = ["main"]


def _sweep_sizes(text: str) -> list[int]:
    key, _, values = text.partition("=")
    try:
        sizes = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if key.strip() != "dsp" or not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sweep {text!r}: expected dsp=N1,N2,... with positive integers")
    return sizes


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of GiB")
    return value


#: where --sweep writes its plot when --plot is not given
DEFAULT_PLOT = "out/dryrun_sweep.png"


def check_plot(path: str) -> Path:
    """``--plot``: a format matplotlib writes, in a directory this user can write: checked before the sweep runs."""
    from dsp_plugin.paths import check_output_file

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--sweep draws its plot with matplotlib, which is not installed; expected "
                         "pip install 'dsp_plugin[bench]'") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        what = f".{suffix} files" if suffix else "a file without a suffix"
        raise ValueError(f"--plot {path}: matplotlib cannot write {what}; expected a file ending in one of "
                         f"{', '.join('.' + f for f in formats)}")
    return check_output_file("--plot", path)  # OutputPathError (a ValueError) naming the path and the reason


def parser() -> argparse.ArgumentParser:
    from dsp_plugin.dryrun.models import available

    p = argparse.ArgumentParser(prog="python -m dsp_plugin.dryrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.1-14b",
                   help=f"one of {', '.join(available())}, or a JSON file of the same form "
                        "(dsp_plugin/dryrun/configs/)")
    p.add_argument("--frames", type=int, help="video frames (pixels), as the user states them; default: the model's")
    p.add_argument("--height", type=int, help="pixels")
    p.add_argument("--width", type=int, help="pixels")
    p.add_argument("--text-len", type=int, dest="text_tokens", help="text tokens (default: the model's encoder length)")
    p.add_argument("--batch", type=int, default=1, help="samples per DSP group (micro-batch)")
    p.add_argument("--dsp", type=int, default=1, help="DSP size N")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel (Megatron models)")
    p.add_argument("--dp", type=int, default=1, help="data parallel")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage (diffusers models)")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false",
                   help="Megatron models: plain DDP instead of --use-distributed-optimizer")
    p.add_argument("--recompute", default="off", choices=("off", "full"), help="activation recompute of every block")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--gpu-memory-gib", type=_positive_gib, default=80.0, help="memory per GPU for 'fits' (default 80)")
    p.add_argument("--calibration", help="measured rates for the step time (dsp_plugin/bench/calibration.py)")
    p.add_argument("--sweep", type=_sweep_sizes, help="dsp=1,2,4,8: one dry run per DSP size, a table and a plot")
    p.add_argument("--plot", help=f"where --sweep writes its plot (default {DEFAULT_PLOT}); checked before the sweep")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from dsp_plugin.bench.calibration import load
    from dsp_plugin.dryrun.report import plot_sweep, render, render_sweep
    from dsp_plugin.dryrun.step import Setup, dry_run

    setup = Setup(model=args.model, frames=args.frames, height=args.height, width=args.width,
                  text_tokens=args.text_tokens, batch=args.batch, dsp=args.dsp, tp=args.tp, dp=args.dp,
                  zero=args.zero, recompute=args.recompute, distributed_optimizer=args.distributed_optimizer,
                  dtype=args.dtype)
    try:
        setup.resolve()
        hw, rows = load(args.calibration)
        if args.plot is not None and not args.sweep:
            raise ValueError(f"--plot {args.plot}: only --sweep draws a plot; expected --sweep dsp=N1,N2,... "
                             f"with it, or no --plot")
        plot = check_plot(args.plot or DEFAULT_PLOT) if args.sweep else None
    except (ValueError, FileNotFoundError) as exc:
        print(f"dsp-dryrun: {exc}", file=sys.stderr)
        return 2
    hardware = "H100 (" + ", ".join(f"{k} {v}" for k, v, _ in rows) + ")"
    if args.sweep:
        runs, refused = [], []
        for n in args.sweep:
            try:
                runs.append(dry_run(replace(setup, dsp=n), hw))
            except ValueError as exc:  # this N cannot run (the plan's own refusal, naming the value)
                refused.append(f"N={n}: {exc}")
        if not runs:
            print("dsp-dryrun: " + "; ".join(refused), file=sys.stderr)
            return 2
        assert plot is not None
        if args.json:  # the table first: a plot that fails after all still leaves the numbers printed
            print(json.dumps({"sweep": [r.as_dict() for r in runs], "refused": refused, "plot": str(plot)}),
                  flush=True)
        else:
            print(f"{setup.model}, {runs[0].geometry}; {runs[0].framework.split(':')[0]}, recompute "
                  f"{setup.recompute}, dp {setup.dp}, tp {setup.tp}; per GPU, GiB; step on {hardware}\n")
            print(render_sweep(runs, gpu_gib=args.gpu_memory_gib))
            for line in refused:
                print(f"cannot run: {line}")
        try:
            plot_sweep(runs, plot, gpu_gib=args.gpu_memory_gib,
                       title=f"{setup.model}: {runs[0].geometry.split(' ->')[0]}, "
                             f"{runs[0].framework.split(':')[0]}, recompute {setup.recompute}")
        except OSError as exc:
            print(f"dsp-dryrun: --plot {plot}: cannot be written ({exc}); the table above is complete", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot: {plot}")
        return 0
    try:
        result = dry_run(setup, hw)
    except ValueError as exc:  # a size the plan or Megatron refuses, named by them
        print(f"dsp-dryrun: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict()) if args.json else render(result, gpu_gib=args.gpu_memory_gib,
                                                                  hardware=hardware))
    return 0
