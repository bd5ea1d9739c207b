"""Check a plan against the model on one process before training on it: ``python -m dsp_plugin.plan.check``.

    python -m dsp_plugin.plan.check --model tiny-hunyuan-video --nproc 2
    python -m dsp_plugin.plan.check --model my_models:tiny_case --plan my_plans:PLAN --nproc 4

Runs one forward and backward of the model parallelized with the plan on N gloo
ranks (CPU, fp64 by default) against the same model on one process
(``dsp_plugin.plan.compare``), and prints per planned module, in call order: its
specs, its calls, the collectives its calls issued forward and backward (count and
bytes sent by the busiest rank), and the largest difference of its outputs and of its
parameters' gradients (summed over the ranks), relative to the largest value of the
one-process run. Exit status 0: equal within ``--rtol``; 1: a difference, naming the
first module that differs (a block whose ``attends=`` names the wrong axis runs and
is wrong: this says where); 2: the run failed (the first rank's error).

``--model``: a built-in tiny model (``dsp_plugin.testing.tiny_video.CASES``), or
``module:attribute`` naming a function (or class) that returns ``(model, inputs)``,
or a model with an ``example_inputs()`` method; inputs are a dict of keyword
arguments, a tuple of positional ones, or ``(args, kwargs)``. Every rank builds it
after ``torch.manual_seed(--seed)``. ``--plan``: ``module:attribute``, a dict or a
function of the model; default: the model's own (``_dsp_plan``, else the built-in one
for its class).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings
from typing import Any

import torch

from dsp_plugin.plan.compare import ROOT, ModuleResult, Result

__all__ = ["main", "run_check"]

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _import(spec: str, what: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: expected module:attribute (e.g. my_models:tiny_case)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: {type(exc).__name__}: {exc}") from None


def build(spec: str, dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The model and its inputs named by ``--model``, in ``dtype``."""
    from dsp_plugin.testing.tiny_video import CASES, cast

    torch.manual_seed(seed)
    made = CASES[spec]() if spec in CASES else _import(spec, "--model")()
    model, inputs = made if isinstance(made, tuple) else (made, getattr(made, "example_inputs", None))
    if callable(inputs):
        inputs = inputs()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {spec!r} gave {type(model).__name__}; expected a torch.nn.Module")
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        args, kwargs = tuple(inputs[0]), inputs[1]
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise TypeError(f"--model {spec!r}: inputs are {type(inputs).__name__}; expected a dict of keyword "
                        f"arguments, a tuple of positional ones, (args, kwargs), or example_inputs() giving one")
    return model.to(dtype), cast(args, dtype), cast(kwargs, dtype)


def _rank(rank: int, n: int, model_spec: str, plan_spec: str | None, dtype: str, seed: int) -> Result:
    from dsp_plugin.plan.compare import compare
    from dsp_plugin.topology import Topology, set_topology

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # third-party warnings out of the table
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    except ImportError:
        pass
    set_topology(Topology.world())
    model, args, kwargs = build(model_spec, DTYPES[dtype], seed)
    plan = _import(plan_spec, "--plan") if plan_spec else None
    return compare(model, args, kwargs, plan, seed=seed)


def run_check(model: str, plan: str | None = None, nproc: int = 2, dtype: str = "float64", seed: int = 0,
              timeout: float = 600) -> list[Result]:
    """Each rank's ``Result`` of ``compare`` for ``--model``/``--plan`` on ``nproc`` gloo ranks."""
    from dsp_plugin.spawn import spawn

    return spawn(_rank, nproc, model, plan, dtype, seed, timeout=timeout, collective_timeout_s=120)


def _kib(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def _collectives(per_rank: list[dict[str, list[int]]]) -> str:
    ops = sorted({op for d in per_rank for op in d})
    return "; ".join(f"{per_rank[0].get(op, [0])[0]} {op} {_kib(max(d.get(op, [0, 0])[1] for d in per_rank))}"
                     for op in ops) or "-"


def _relative(diff: float | None, scale: float) -> float | None:
    return None if diff is None else diff / scale if scale > 0 else diff


def _fmt(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.2g}"


def report(results: list[Result], rtol: float, title: str) -> tuple[list[str], str | None]:
    """(lines to print, the verdict line if something differs) from every rank's result."""
    header = (f"{'module':<36} {'specs':<22} {'calls':>5}  {'forward':<28} {'backward':<28} "
              f"{'output':>8} {'grads':>8}")
    lines = [title, header]
    outputs, gradients = [], []
    for i, row in enumerate(results[0].modules):
        rows: list[ModuleResult] = [r.modules[i] for r in results]
        out = _relative(max((r.out_diff for r in rows if r.out_diff is not None), default=None),
                        max(r.out_scale for r in rows))
        grad = _relative(max((r.grad_diff for r in rows if r.grad_diff is not None), default=None),
                         max(r.grad_scale for r in rows))
        name = row.path or "(root)"
        if out is not None and out > rtol:
            outputs.append((row.finished, name))
        if grad is not None and grad > rtol:
            gradients.append((-row.finished, name))
        flag = "  DIFFERS" if any(x is not None and x > rtol for x in (out, grad)) else ""
        note = next((r.note for r in rows if r.note), "")
        lines.append(f"{name:<36} {row.specs:<22} {row.calls:>5}  {_collectives([r.forward for r in rows]):<28} "
                     f"{_collectives([r.backward for r in rows]):<28} {_fmt(out):>8} {_fmt(grad):>8}{flag}"
                     + (f"  ({note})" if note else ""))
    outside = [[r.outside.get(phase, {}) for r in results] for phase in ("forward", "backward")]
    if any(outside[0]) or any(outside[1]):
        lines.append(f"{ROOT:<36} {'':<22} {'':>5}  {_collectives(outside[0]):<28} {_collectives(outside[1]):<28}")
    model = {k: max(getattr(r, k) for r in results) for k in ("out_diff", "out_scale", "input_grad_diff",
                                                              "input_grad_scale", "grad_diff", "grad_scale")}
    overall = {k: _relative(model[f"{k}_diff"], model[f"{k}_scale"]) for k in ("out", "input_grad", "grad")}
    lines.append(f"model: output {_fmt(overall['out'])} (of |{model['out_scale']:.3g}|), input gradients "
                 f"{_fmt(overall['input_grad'])} (of |{model['input_grad_scale']:.3g}|), parameter gradients "
                 f"{_fmt(overall['grad'])} (of |{model['grad_scale']:.3g}|); differences relative to the "
                 f"largest one-process value, rtol {rtol:g}")
    notes = sorted({note for r in results for note in r.notes})
    lines.extend(f"note: {note}" for note in notes)
    if outputs:
        first, *rest = [name for _, name in sorted(outputs)]
        return lines, (f"DIFFERS: {first} is the first module whose output differs from one process (in forward "
                       f"order" + (f"; then {', '.join(rest)})" if rest else ")"))
    if gradients:
        first, *rest = [name for _, name in sorted(gradients)]
        return lines, (f"DIFFERS: the outputs agree; {first} is the first module whose parameters' gradients "
                       f"differ (in backward order" + (f"; then {', '.join(rest)})" if rest else ")"))
    if any(x is not None and x > rtol for x in overall.values()) or notes:
        return lines, "DIFFERS: the model's output, input gradients or gradients differ (above)"
    return lines, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.plan.check",
                                     description="One forward and backward of a model under a plan on N gloo ranks "
                                                 "against the model on one process, per planned module.")
    parser.add_argument("--model", required=True, help="a built-in tiny model (e.g. tiny-wan, tiny-hunyuan-video) "
                                                       "or module:attribute returning (model, inputs)")
    parser.add_argument("--plan", default=None, help="module:attribute of a plan (a dict or a function of the "
                                                     "model); default: the model's built-in plan")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64", help="default float64")
    parser.add_argument("--rtol", type=float, default=1e-6,
                        help="largest difference allowed, relative to the largest one-process value (default 1e-6)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building (default 0)")
    args = parser.parse_args(argv)
    from dsp_plugin.testing.tiny_video import CASES

    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: expected at least 1")
    try:  # before any process is spawned
        if args.model not in CASES:
            _import(args.model, "--model")
        if args.plan:
            _import(args.plan, "--plan")
    except ValueError as exc:
        parser.error(f"{exc} (built-in tiny models: {', '.join(CASES)})" if "--model" in str(exc) else str(exc))
    from dsp_plugin.spawn import SpawnError

    try:
        results = run_check(args.model, args.plan, args.nproc, args.dtype, args.seed)
    except SpawnError as exc:
        print(f"dsp_plugin.plan.check: the run failed: {exc}", file=sys.stderr)
        return 2
    title = (f"dsp_plugin.plan.check: --model {args.model}, plan {args.plan or 'built-in'}, {args.nproc} gloo "
             f"ranks, {args.dtype}")
    lines, verdict = report(results, args.rtol, title)
    print("\n".join(lines))
    if verdict is not None:
        print(verdict)
        return 1
    print(f"OK: equal to one process on {args.nproc} ranks within rtol {args.rtol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
