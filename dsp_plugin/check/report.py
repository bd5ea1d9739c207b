"""The plan checker's report from every rank's ``compare.Result``: the table, the verdict, the tolerance, JSON.

Every tensor of every planned module's output (``compare.Element``) is judged on
its own, forward (its value) and backward (its gradient), and so are the module's
parameters' gradients: a difference ``d`` fails when ``d > atol + rtol * s``, ``s``
the largest one-process value of the module's output tensors (of their gradients,
of its parameters' gradients): a tensor far smaller than the others beside it (a
text stream's gradient beside the video's) is not judged by its own rounding. The
table prints ``d / s`` (the largest over the module's output tensors). A tensor
that could not be placed against one process is not compared, and the verdict is
not OK then.

The tolerance: ``--rtol`` if given; else 1e-6 in float64, and in the model's own
dtypes (or float32) the square root of the machine epsilon of the coarsest
floating dtype of the model's parameters and buffers (half its digits: fp32
3.5e-4, bf16 0.088, fp16 0.031). A plan that is right differs from one process by
rounding only (tiny fp32 Cosmos and Kandinsky 5: at most 1e-6); a wrong one by
1e-2 and more (Latte's temporal blocks said to attend the patches: 0.072).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsp_plugin.check.compare import ROOT, Result

__all__ = ["FLOAT64_RTOL", "Verdict", "derived_rtol", "report", "to_json"]

FLOAT64_RTOL = 1e-6


def derived_rtol(mode: str, dtypes: list[str]) -> float:
    """The default ``rtol`` of a run in ``mode`` (float64, float32, model) of a model holding ``dtypes``."""
    eps = [torch.finfo(getattr(torch, d)).eps for d in dtypes if d != "float64"]
    if mode == "float64" or not eps:
        return FLOAT64_RTOL
    return math.sqrt(max(eps))


def _exceeds(diff: float | None, scale: float, rtol: float, atol: float) -> bool:
    return diff is not None and (math.isnan(diff) or diff > atol + rtol * scale)


def _relative(diff: float | None, scale: float) -> float | None:
    return None if diff is None else diff / scale if scale > 0 else diff


def _fmt(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.2g}"


def _kib(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def _collectives(per_rank: list[dict[str, list[int]]]) -> str:
    ops = sorted({op for d in per_rank for op in d})
    return "; ".join(f"{per_rank[0].get(op, [0])[0]} {op} {_kib(max(d.get(op, [0, 0])[1] for d in per_rank))}"
                     for op in ops) or "-"


@dataclass
class _Row:
    """A module's figures over every rank: per output tensor ``[diff, scale]`` forward and backward, notes."""

    path: str
    specs: str
    calls: int
    finished: int
    forward: str
    backward: str
    out: dict[str, list[Any]] = field(default_factory=dict)
    out_grad: dict[str, list[Any]] = field(default_factory=dict)
    grad: list[Any] = field(default_factory=lambda: [None, 0.0])
    notes: dict[str, str] = field(default_factory=dict)  # output tensor -> why not compared
    note: str = ""


def _merge(a: list[Any], diff: float | None, scale: float) -> None:
    if diff is not None:
        a[0] = diff if a[0] is None else max(a[0], diff)
    a[1] = max(a[1], scale)


def _module_scale(figures: dict[str, list[Any]]) -> None:
    """Every tensor's ``[diff, scale]`` judged against the largest scale of the module's tensors (docstring)."""
    scale = max((s for _, s in figures.values()), default=0.0)
    for figure in figures.values():
        figure[1] = scale


def _rows(results: list[Result]) -> list[_Row]:
    rows = []
    for i, first in enumerate(results[0].modules):
        per_rank = [r.modules[i] for r in results]
        row = _Row(first.path or "(root)", first.specs, first.calls, first.finished,
                   _collectives([m.forward for m in per_rank]), _collectives([m.backward for m in per_rank]),
                   note=next((m.note for m in per_rank if m.note), ""))
        for m in per_rank:
            _merge(row.grad, m.grad_diff, m.grad_scale)
            for e in m.elements:
                _merge(row.out.setdefault(e.name, [None, 0.0]), e.out_diff, e.out_scale)
                _merge(row.out_grad.setdefault(e.name, [None, 0.0]), e.grad_diff, e.grad_scale)
                if e.note:
                    row.notes.setdefault(e.name, e.note)
        _module_scale(row.out)
        _module_scale(row.out_grad)
        rows.append(row)
    return rows


@dataclass
class Verdict:
    status: str  # "OK", "DIFFERS" or "NOT CHECKED"
    line: str
    lines: list[str]
    data: dict[str, Any]


def report(results: list[Result], rtol: float, atol: float, title: str, nproc: int) -> Verdict:
    """The table, the verdict and the JSON report's fields from every rank's result."""
    def differing(figures: dict[str, list[Any]]) -> list[str]:
        return [name for name, (d, s) in figures.items() if _exceeds(d, s, rtol, atol)]

    def largest(figures: dict[str, list[Any]]) -> float | None:
        return max((r for r in (_relative(d, s) for d, s in figures.values()) if r is not None), default=None)

    header = (f"{'module':<36} {'specs':<22} {'calls':>5}  {'forward':<28} {'backward':<28} "
              f"{'output':>8} {'out grad':>8} {'grads':>8}")
    lines, modules = [title, header], []
    outputs, out_grads, gradients, unchecked = [], [], [], []
    for row in _rows(results):
        bad_out, bad_out_grad = differing(row.out), differing(row.out_grad)
        bad_grad = _exceeds(*row.grad, rtol, atol)
        if bad_out:
            outputs.append((row.finished, row.path, bad_out))
        if bad_out_grad:
            out_grads.append((-row.finished, row.path, bad_out_grad))
        if bad_grad:
            gradients.append((-row.finished, row.path, []))
        unchecked.extend(f"{row.path} {name} ({why})" for name, why in row.notes.items())
        flag = ""
        if bad_out or bad_out_grad or bad_grad:
            where = sorted(set(bad_out) | set(bad_out_grad))
            flag = "  DIFFERS" + (f" at {', '.join(where)}" if where and list(row.out) != ["output"] else "")
        elif row.notes:
            flag = "  NOT CHECKED"
        note = "; ".join(([row.note] if row.note else []) + [f"{n}: {w}" for n, w in row.notes.items()])
        out, out_grad, grad = largest(row.out), largest(row.out_grad), _relative(*row.grad)
        lines.append(f"{row.path:<36} {row.specs:<22} {row.calls:>5}  {row.forward:<28} {row.backward:<28} "
                     f"{_fmt(out):>8} {_fmt(out_grad):>8} {_fmt(grad):>8}{flag}" + (f"  ({note})" if note else ""))
        modules.append({
            "path": row.path, "specs": row.specs, "calls": row.calls, "forward": row.forward,
            "backward": row.backward, "grads": grad, "differs": bool(flag.strip().startswith("DIFFERS")),
            "outputs": [{"name": name, "output": _relative(*row.out[name]),
                         "output_grad": _relative(*row.out_grad.get(name, [None, 0.0])),
                         "differs": name in bad_out or name in bad_out_grad, "note": row.notes.get(name, "")}
                        for name in row.out]})
    outside = [[r.outside.get(phase, {}) for r in results] for phase in ("forward", "backward")]
    if any(outside[0]) or any(outside[1]):
        lines.append(f"{ROOT:<36} {'':<22} {'':>5}  {_collectives(outside[0]):<28} {_collectives(outside[1]):<28}")
    model = {k: max(getattr(r, k) for r in results) for k in ("out_diff", "out_scale", "input_grad_diff",
                                                              "input_grad_scale", "grad_diff", "grad_scale")}
    overall = {k: _relative(model[f"{k}_diff"], model[f"{k}_scale"]) for k in ("out", "input_grad", "grad")}
    bad_model = any(_exceeds(model[f"{k}_diff"], model[f"{k}_scale"], rtol, atol)
                    for k in ("out", "input_grad", "grad"))
    lines.append(f"model: output {_fmt(overall['out'])} (of |{model['out_scale']:.3g}|), input gradients "
                 f"{_fmt(overall['input_grad'])} (of |{model['input_grad_scale']:.3g}|), parameter gradients "
                 f"{_fmt(overall['grad'])} (of |{model['grad_scale']:.3g}|); differences relative to the "
                 f"largest one-process value, rtol {rtol:g}" + (f", atol {atol:g}" if atol else ""))
    notes = sorted({note for r in results for note in r.notes})
    lines.extend(f"note: {note}" for note in notes)
    status, line = _verdict(outputs, out_grads, gradients, unchecked, bad_model or bool(notes), nproc, rtol)
    data = {"status": status, "verdict": line, "rtol": rtol, "atol": atol, "nproc": nproc,
            "dtypes": results[0].dtypes, "checked_in": results[0].dtype_mode, "dtype_note": results[0].dtype_note,
            "model": {"output": overall["out"], "input_gradients": overall["input_grad"],
                      "parameter_gradients": overall["grad"]},
            "notes": notes, "modules": modules}
    return Verdict(status, line, lines, data)


def _at(names: list[str]) -> str:
    return "" if names == ["output"] else f", at {', '.join(names)}"


def _verdict(outputs: list[Any], out_grads: list[Any], gradients: list[Any], unchecked: list[str], bad_model: bool,
             nproc: int, rtol: float) -> tuple[str, str]:
    def then(found: list[Any]) -> str:
        rest = [path for _, path, _ in sorted(found)[1:]]
        return f"; then {', '.join(rest)})" if rest else ")"

    if outputs:
        _, first, names = min(outputs)
        return "DIFFERS", (f"DIFFERS: {first} is the first module whose output differs from one process"
                           f"{_at(names)} (in forward order" + then(outputs))
    if out_grads:
        _, first, names = min(out_grads)
        return "DIFFERS", (f"DIFFERS: the outputs agree; {first} is the first module whose output's gradient "
                           f"differs{_at(names)} (in backward order" + then(out_grads))
    if gradients:
        _, first, _ = min(gradients)
        return "DIFFERS", (f"DIFFERS: the outputs agree; {first} is the first module whose parameters' gradients "
                           f"differ (in backward order" + then(gradients))
    if bad_model:
        return "DIFFERS", "DIFFERS: the model's output, input gradients or gradients differ (above)"
    if unchecked:
        return "NOT CHECKED", (f"NOT CHECKED: {unchecked[0]}" + (f"; and {len(unchecked) - 1} more"
                                                                 if len(unchecked) > 1 else "")
                               + "; the rest is equal to one process")
    return "OK", f"OK: equal to one process on {nproc} ranks within rtol {rtol:g}"


def to_json(data: dict[str, Any], **fields: Any) -> str:
    """The JSON report: ``data`` from ``report`` (or a failed run's fields) with ``fields`` first."""
    return json.dumps({**fields, **data}, indent=1, default=str) + "\n"
