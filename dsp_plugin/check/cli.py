"""Check a plan against the model on one process before training on it: ``python -m dsp_plugin.check``.

    python -m dsp_plugin.check --model tiny-hunyuan-video --nproc 2
    python -m dsp_plugin.check --model my_models:tiny_case --plan my_plans:PLAN --nproc 4 --json report.json

Runs one forward and backward of the model parallelized with the plan on N gloo
ranks (CPU) against the same model on one process (``dsp_plugin.check.compare``),
and prints per planned module, in call order: its specs, its calls, the
collectives its calls issued forward and backward (count and bytes sent by the
busiest rank), and the largest difference of its output tensors (every tensor of a
tuple, list, dict or diffusers output class), of their gradients, and of its
parameters' gradients (summed over the ranks), relative to the one-process values
(``dsp_plugin.check.report``). Exit status 0: equal within the tolerance; 1: a difference,
naming the first module that differs and which of its output tensors (a block
whose ``attends=`` names the wrong axis runs and is wrong: this says where), or a
tensor that could not be compared; 2: a bad argument, or the run failed (the first
rank's error).

``--dtype``: float64 (the model and its inputs cast), float32, or ``model`` (the
model's own dtypes, with a tolerance derived from them). By default float64, and
the model's own dtypes where the model fails in float64 on one process (models
that keep modules in fp32, such as Cosmos and Kandinsky 5), said in one line.

``--model``: a built-in tiny model (``dsp_plugin.testing.tiny_video.CASES``), or
``module:attribute`` naming a function (or class) that returns ``(model, inputs)``,
or a model with an ``example_inputs()`` method; inputs are a dict of keyword
arguments, a tuple of positional ones, or ``(args, kwargs)``. Every rank builds it
after ``torch.manual_seed(--seed)``. ``--plan``: ``module:attribute``, a dict or a
function of the model; default: the model's own (``_dsp_plan``, else the built-in
one for its class). Every argument is checked before a rank starts (a function
plan is called once here, on the model built as a rank builds it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import warnings
from typing import Any

import torch

from dsp_plugin.check.compare import Result

__all__ = ["load_plan", "main", "run_check"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "model": None}


def _import(spec: str, what: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: expected module:attribute (e.g. my_models:tiny_case)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: {type(exc).__name__}: {exc}") from None


def load_plan(spec: str) -> Any:
    """The plan ``--plan`` names: a dict ``{module path: spec or [specs]}`` (checked here) or a function of the
    model; a ValueError naming the value and what was expected otherwise."""
    from dsp_plugin.plan.frames import OnShard
    from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

    plan = _import(spec, "--plan")
    kinds = (Block, Gather, Grid, Heads, OnShard, Positions, Split)
    if isinstance(plan, dict):
        for path, specs in plan.items():
            listed = list(specs) if isinstance(specs, (list, tuple)) else [specs]
            bad = next((s for s in listed if not isinstance(s, kinds)), None)
            if not isinstance(path, str) or bad is not None or not listed:
                raise ValueError(f"--plan {spec!r}: entry {path!r}: {bad if listed else specs!r}; expected a module "
                                 f"path (str) mapped to a spec or a list of specs (Split, Block, Heads, Gather, "
                                 f"Grid, Positions, OnShard)")
        return plan
    if callable(plan) and not isinstance(plan, type):
        return plan
    raise ValueError(f"--plan {spec!r} is a {type(plan).__name__}; expected a plan: a dict {{module path: spec}} "
                     f"or a function of the model returning one")


def _call_plan(spec: str, plan: Any, model: torch.nn.Module) -> dict[str, Any]:
    """A function plan called on ``model``: its dict, or a ValueError (TypeError) naming what it did instead."""
    try:
        resolved = plan(model)
    except Exception as exc:  # noqa: BLE001 - any error of a user's function is reported as the argument's
        raise ValueError(f"--plan {spec!r}: calling it with the model ({type(model).__name__}) raised "
                         f"{type(exc).__name__}: {exc}; expected a function of the model returning a plan dict "
                         f"{{module path: spec}}") from None
    if not isinstance(resolved, dict):
        raise TypeError(f"--plan {spec!r}: called with the model it returned a {type(resolved).__name__}; "
                         f"expected a plan dict {{module path: spec}}")
    return resolved


def build(spec: str, dtype: torch.dtype | None, seed: int) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The model and its inputs named by ``--model``, in ``dtype`` (None: as built)."""
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
    if dtype is None:
        return model, args, kwargs
    return model.to(dtype), cast(args, dtype), cast(kwargs, dtype)


def _fails_in(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The error of one forward and backward of ``model`` on one process (no collective), or None."""
    from dsp_plugin.plan.args import tensors

    try:
        out = [t for t in tensors(model(*args, **kwargs)) if t.requires_grad]
        if out:
            sum(t.double().sum() for t in out).backward()
        model.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - any failure of the model in this dtype
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _quiet() -> None:
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # third-party warnings out of the table
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    except ImportError:
        pass


def _rank(rank: int, n: int, model_spec: str, plan_spec: str | None, dtype: str, seed: int) -> Result:
    """One rank's check. ``dtype`` "auto": float64, else the model's own dtypes where the model fails in float64
    on one process (every rank builds the same model and finds the same)."""
    from dsp_plugin.check.compare import compare
    from dsp_plugin.topology import Topology, set_topology

    _quiet()
    set_topology(Topology.world())
    mode, note = ("float64" if dtype == "auto" else dtype), ""
    model, args, kwargs = build(model_spec, DTYPES[mode], seed)
    if dtype == "auto":
        error = _fails_in(model, args, kwargs)
        if error is not None:
            mode, note = "model", f"float64 fails on one process ({error})"
            model, args, kwargs = build(model_spec, None, seed)
    plan = load_plan(plan_spec) if plan_spec else None
    if plan is not None and callable(plan):
        plan = _call_plan(plan_spec, plan, model)
    result = compare(model, args, kwargs, plan, seed=seed)
    result.dtype_mode, result.dtype_note = mode, note
    return result


def run_check(model: str, plan: str | None = None, nproc: int = 2, dtype: str = "auto", seed: int = 0,
              timeout: float = 600) -> list[Result]:
    """Each rank's ``Result`` of ``compare`` for ``--model``/``--plan`` on ``nproc`` gloo ranks."""
    from dsp_plugin.spawn import spawn

    return spawn(_rank, nproc, model, plan, dtype, seed, timeout=timeout, collective_timeout_s=120)


def _validate(args: argparse.Namespace) -> None:
    """Every argument, before a rank starts: a ValueError (or TypeError) naming the value and what was expected."""
    from dsp_plugin.testing.tiny_video import CASES

    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: expected at least 1 rank")
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name} {value:g}: expected a finite tolerance >= 0 (a difference d of a tensor whose "
                             f"largest one-process value is s fails when d > atol + rtol * s)")
    if args.json and args.json != "-":
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json {args.json!r}: expected a file path in a writable directory (or - for "
                             f"stdout)")
    if args.model not in CASES:
        try:
            made = _import(args.model, "--model")
        except ValueError as exc:
            raise ValueError(f"{exc} (built-in tiny models: {', '.join(CASES)})") from None
        if not callable(made):
            raise ValueError(f"--model {args.model!r} is a {type(made).__name__}; expected a function (or class) "
                             f"returning (model, inputs) or a model with example_inputs()")
    if args.plan:
        plan = load_plan(args.plan)
        if callable(plan):  # only a model tells what a function does: build it as a rank does
            _quiet()
            _call_plan(args.plan, plan, build(args.model, None, args.seed)[0])


def main(argv: list[str] | None = None) -> int:
    from dsp_plugin.check.report import derived_rtol, report, to_json

    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.check",
                                     description="One forward and backward of a model under a plan on N gloo ranks "
                                                 "against the model on one process, per planned module.")
    parser.add_argument("--model", required=True, help="a built-in tiny model (e.g. tiny-wan, tiny-hunyuan-video) "
                                                       "or module:attribute returning (model, inputs)")
    parser.add_argument("--plan", default=None, help="module:attribute of a plan (a dict or a function of the "
                                                     "model); default: the model's built-in plan")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="float64 (default; the model's own dtypes where the model fails in float64), float32, "
                             "or model: its own dtypes, with a tolerance derived from them")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest difference allowed, relative to the largest one-process value of the tensor "
                             "(default 1e-6 in float64, else derived from the dtypes the model computes in)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute difference allowed on top (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building (default 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON to PATH (-: "
                                                                     "print it instead of the table)")
    args = parser.parse_args(argv)
    try:  # before any process is spawned
        _validate(args)
    except (ValueError, TypeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    from dsp_plugin.spawn import SpawnError

    fields = {"model_spec": args.model, "plan_spec": args.plan or "built-in"}
    try:
        results = run_check(args.model, args.plan, args.nproc, args.dtype or "auto", args.seed)
    except SpawnError as exc:
        print(f"dsp_plugin.check: the run failed: {exc}", file=sys.stderr)
        if args.json:
            _write(args.json, to_json({"status": "FAILED", "verdict": f"the run failed: {exc}"}, **fields))
        return 2
    mode = results[0].dtype_mode
    rtol = args.rtol if args.rtol is not None else derived_rtol(mode, results[0].dtypes)
    title = (f"dsp_plugin.check: --model {args.model}, plan {args.plan or 'built-in'}, {args.nproc} gloo "
             f"ranks, " + ("the model's own dtypes (" + ", ".join(results[0].dtypes) + ")" if mode == "model"
                           else mode))
    verdict = report(results, rtol, args.atol, title, args.nproc)
    lines = verdict.lines + [verdict.line]
    if results[0].dtype_note:
        lines.insert(1, f"dtype: {results[0].dtype_note}: checked in the model's own dtypes "
                        f"({', '.join(results[0].dtypes)}), rtol {rtol:g} (--dtype float64 to insist)")
    if args.json:
        _write(args.json, to_json(verdict.data, **fields))
    if args.json != "-":
        print("\n".join(lines))
    return 0 if verdict.status == "OK" else 1


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
