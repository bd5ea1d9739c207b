"""``python -m dsp_plugin.bench``: DSP and four baselines on N CPU ranks, plus the scale model.

    python -m dsp_plugin.bench                  # N=4, full size, checkpointing off and on
    python -m dsp_plugin.bench --quick --nproc 2
    python -m dsp_plugin.bench --scale-only     # only the 128-H100 predictions
    python -m dsp_plugin.bench --scale-only --calibration measured.json
    python -m dsp_plugin.bench --wan-only --nproc 2   # only the full-3D section: Wan + the mixed model
    python -m dsp_plugin.bench --no-wan         # leave the Wan row out
    python -m dsp_plugin.bench --costs --quick --nproc 2   # only the costs (a few minutes; alias --costs-only)
    python -m dsp_plugin.bench --costs --device cuda:0    # only the runtime's A/B against the hand-written Wan, there
    python -m dsp_plugin.bench.mixed            # only the mixed-model table (factorized + full blocks)

The ranks run on NCCL, one GPU each, when CUDA is present, else on gloo and the CPU
(``dsp_plugin.backend``; ``DSP_BACKEND=gloo`` forces the CPU).

Writes ``bench_n{N}.json``, ``bench_n{N}.md``, ``bench_n{N}.png`` and
``scale_model.png`` under ``--out`` (default ``bench_out/``), then the full-3D
section: the Wan row (``dsp_plugin.bench.wan``: our plan against diffusers' own
Ulysses on the same model and inputs, counts, equality and the time ratio of
one run) as ``wan_n{N}.md`` and the mixed model's table
(``dsp_plugin.bench.mixed``: DSP switches + head switch against Ulysses
everywhere, in bytes) as ``mixed_n{N}.md``, and last the costs section
(``dsp_plugin.bench.costs``: bf16 vs FP8 bytes and time per switch and head
switch; what the plan runtime costs a Wan step, against the Wan made parallel by
hand and by its clock; its Python calls per step eager and compiled) as
``costs_n{N}.md`` and ``.json``. Progress goes to stderr; the tables to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from dsp_plugin.backend import choose
from dsp_plugin.bench import calibration, report, scale_markdown, scale_report
from dsp_plugin.bench.config import FULL, METHODS, QUICK
from dsp_plugin.spawn import spawn


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
    parser.add_argument("--wan-only", action="store_true",
                        help="only the full-3D section: Wan (our plan against diffusers' Ulysses) and the mixed model")
    parser.add_argument("--no-wan", action="store_true", help="leave the Wan row out")
    parser.add_argument("--costs", "--costs-only", dest="costs", action="store_true",
                        help="only the costs section: bf16 vs FP8 on the wire, what the plan runtime costs a Wan step "
                             "(with --quick: a few minutes on 2 CPU cores)")
    parser.add_argument("--no-costs", action="store_true", help="leave the costs section out")
    parser.add_argument("--size", default=None, metavar="L,H,D,F,HW",
                        help="with --costs: the Wan's layers, heads, head dim, latent frames, latent height = width")
    parser.add_argument("--device", default="cpu",
                        help="with --costs: a CUDA device runs only the A/B against the hand-written Wan, there "
                             "(wall time; forward and training step)")
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
    if args.wan_only and (args.no_wan or args.scale_only):
        parser.error("--wan-only: runs only the Wan row and the mixed model; it excludes --no-wan and --scale-only")
    if args.costs and (args.wan_only or args.scale_only or args.no_costs):
        parser.error("--costs: runs only the costs section; it excludes --wan-only, --scale-only and --no-costs")
    if (args.size is not None or args.device != "cpu") and not args.costs:
        parser.error(f"--size={args.size}, --device={args.device}: expected with --costs only")
    if args.size is not None:
        given, args.size = args.size, tuple(int(v) for v in args.size.split(",") if v.strip().isdigit())
        if len(args.size) != 5 or len(given.split(",")) != 5:
            parser.error(f"--size={given}: expected 5 integers L,H,D,F,HW (layers, heads, head dim, latent "
                         "frames, latent height = width), e.g. 4,12,16,8,16")
    args.methods = methods
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.costs:
        written = _costs(args)
        print(f"\n[bench] wrote {', '.join(map(str, written))}", file=sys.stderr)
        return 0
    if args.wan_only:
        cfg = QUICK if args.quick else FULL
        written = _full3d(args, dataclasses.replace(cfg, steps=args.steps or cfg.steps))
        print(f"\n[bench] wrote {', '.join(map(str, written))}", file=sys.stderr)
        return 0
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
    written = _full3d(args, cfg)
    if not args.no_costs:
        written += _costs(args)
    pngs = f", {stem}.png, {args.out / 'scale_model.png'}" if plotted else ""
    print(f"\n[bench] wrote {stem}.json, {stem}.md, {', '.join(map(str, written))}{pngs} in "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def _full3d(args: argparse.Namespace, cfg: Any) -> list[Path]:
    """The full-3D section: the Wan row (unless ``--no-wan``) and the mixed model; returns the files written."""
    from dsp_plugin.bench import mixed, wan

    written = []
    if not args.no_wan:
        print(f"[bench] Wan: our plan and diffusers' Ulysses on {args.nproc} ranks, alternating rounds",
              file=sys.stderr, flush=True)
        row = wan.wan_row(args.nproc, quick=args.quick, steps=args.steps or wan.ROUNDS)
        wan_md = wan.markdown(row)
        written += [args.out / f"wan_n{args.nproc}.md", args.out / f"wan_n{args.nproc}.json"]
        written[-2].write_text(wan_md + "\n")
        written[-1].write_text(json.dumps(row, indent=2, default=str) + "\n")
        print(f"\n## Full 3D: Wan\n\n{wan_md}", flush=True)
    # factorized + full-attention blocks: DSP against Ulysses everywhere
    mixed_md = mixed.run(args.nproc, mixed.PATTERN, mixed.QUICK_SHAPE if args.quick else mixed.SHAPE, mixed.HEADS,
                         reps=cfg.steps)
    written.append(args.out / f"mixed_n{args.nproc}.md")
    written[-1].write_text(mixed_md + "\n")
    print(f"\n## Mixed model\n\n{mixed_md}", flush=True)
    return written


def _costs(args: argparse.Namespace) -> list[Path]:
    """The costs section (``dsp_plugin.bench.costs``); returns the files written."""
    from dsp_plugin.bench import costs

    if args.device != "cpu":  # the A/B alone, on the device: rank 0 of a fake world, wall time
        tables = [costs.ab_markdown(costs.measure_against_hand(args.nproc, args.size, rounds=args.steps or 30,
                                                               device=args.device, backward=backward))
                  for backward in (False, True)]
        print("\n## The plan runtime's cost against the Wan made parallel by hand\n\n" + "\n\n".join(tables))
        (args.out / "costs_device.md").write_text("\n\n".join(tables) + "\n")
        return [args.out / "costs_device.md"]
    print(f"[bench] costs: FP8 on the wire, what the plan runtime costs, on {args.nproc} ranks", file=sys.stderr,
          flush=True)
    result = costs.run(args.nproc, quick=args.quick, rounds=args.steps, size=args.size)
    print(f"\n## Costs: FP8 on the wire, the plan runtime\n\n{costs.markdown(result)}", flush=True)
    return costs.write(result, args.out)


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
