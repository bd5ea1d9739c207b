"""``python -m dsp_plugin.bench``: DSP and four baselines on N CPU ranks, plus the scale model.

    python -m dsp_plugin.bench                  # N=4, full size, checkpointing off and on
    python -m dsp_plugin.bench --quick --nproc 2
    python -m dsp_plugin.bench --scale-only     # only the 128-H100 predictions
    python -m dsp_plugin.bench --scale-only --calibration measured.json
    python -m dsp_plugin.bench.mixed            # only the mixed-model table (factorized + full blocks)

The ranks run on NCCL, one GPU each, when CUDA is present, else on gloo and the CPU
(``dsp_plugin.runtime``; ``DSP_BACKEND=gloo`` forces the CPU).

Writes ``bench_n{N}.json``, ``bench_n{N}.md``, ``bench_n{N}.png`` and
``scale_model.png`` under ``--out`` (default ``bench_out/``), and the mixed model's
table (``dsp_plugin.bench.mixed``: DSP switches + head switch against Ulysses
everywhere, in bytes) as ``mixed_n{N}.md``. Progress goes to
stderr; the tables to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from dsp_plugin.bench import calibration, report, scale_markdown, scale_report
from dsp_plugin.runtime import choose
from dsp_plugin.spawn import spawn
from dsp_plugin.bench.config import FULL, METHODS, QUICK


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, choices=(2, 4), help="ranks (default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 10 timed steps (1-3 minutes on 2 CPU cores; progress on stderr)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (default bench_out/)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (at least 10)")
    parser.add_argument("--scale-only", action="store_true", help="print the scale model and exit")
    parser.add_argument("--calibration", type=Path, default=None,
                        help=f"JSON of measured figures for the scale model (default: ${calibration.ENV}, "
                             f"else ./{calibration.DEFAULT_FILE} when present)")
    args = parser.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; expected a subset of {list(METHODS)}")
    if args.steps is not None and args.steps < 10:
        parser.error(f"--steps={args.steps}: the median needs at least 10 timed steps")
    args.methods = methods
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    hw, calibration_rows = calibration.load(args.calibration)
    scale_md = scale_markdown.markdown(hw, calibration_rows)
    (args.out / "scale_model.md").write_text(scale_md + "\n")
    if args.scale_only:
        print(scale_md, flush=True)
        _plot(args.out / "scale_model.png", report.plot_scale, args.out / "scale_model.png", hw)
        return 0
    _plot(args.out / "scale_model.png", report.plot_scale, args.out / "scale_model.png", hw)

    cfg = QUICK if args.quick else FULL
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    mode = "quick" if args.quick else "full"
    print(f"[bench] {len(args.methods)} methods on {args.nproc} ranks, {choose(local_rank=0).backend} ({mode})",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    per_rank = spawn("dsp_plugin.bench.runner:worker", args.nproc, cfg, args.methods, timeout=900,
                     collective_timeout_s=120, backend="auto")
    summary = report.summarize(per_rank, cfg, args.nproc)
    summary["wall_s"] = time.perf_counter() - start
    summary["scale_model"] = [
        {"model": r["model"], "tokens": r["tokens"], "method": m, "size": r["sizes"][m],
         "step_s": p.step_s if p is not None and p.feasible else None, "over_dsp": r["over_dsp"][m]}
        for r in scale_report.e2e_rows(hw) for m, p in r["preds"].items()]

    stem = args.out / f"bench_n{args.nproc}"
    table = report.markdown(summary)
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(table + "\n\n## Scale model\n\n" + scale_md + "\n")
    print(table)
    print()
    print(scale_md, flush=True)
    plotted = _plot(stem.with_suffix(".png"), report.plot, summary, stem.with_suffix(".png"))
    from dsp_plugin.bench import mixed  # factorized + full-attention blocks: DSP against Ulysses everywhere

    mixed_md = mixed.run(args.nproc, mixed.PATTERN, mixed.QUICK_SHAPE if args.quick else mixed.SHAPE, mixed.HEADS,
                         reps=cfg.steps)
    mixed_path = args.out / f"mixed_n{args.nproc}.md"
    mixed_path.write_text(mixed_md + "\n")
    print(f"\n## Mixed model\n\n{mixed_md}")
    pngs = f", {stem}.png, {args.out / 'scale_model.png'}" if plotted else ""
    print(f"\n[bench] wrote {stem}.json, {stem}.md, {mixed_path}{pngs} in {summary['wall_s']:.1f}s", file=sys.stderr)
    return 0


def _plot(path: Path, fn: Any, *args: Any) -> bool:
    """Draw a figure when matplotlib is installed; otherwise say how to get it (the tables are already out)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"[bench] no plot {path}: matplotlib is not installed "
              "(pip install 'dsp_plugin[bench]'); the tables above are complete", file=sys.stderr)
        return False
    fn(*args)
    return True


if __name__ == "__main__":
    sys.exit(main())
