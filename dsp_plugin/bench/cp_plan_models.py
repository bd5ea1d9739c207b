"""The diffusers models with a ``_cp_plan``: our built-in plan beside diffusers' own Ulysses, in bytes, one forward.

    python -m dsp_plugin.bench.cp_plan_models --nproc 2      # also --nproc 4; --quick: the smallest shapes

For every diffusers transformer whose class declares ``_cp_plan`` (and Cosmos 3,
whose context parallelism diffusers keeps outside the model), on N gloo ranks
(CPU, fp64 by default), the same tiny random-weight model (``dsp_plugin.testing``'s
builders at a shape diffusers' Ulysses can run: heads and every sequence it splits
divisible by N) and the same inputs, three ways: ``dsp_plugin.parallelize(model)``
(its built-in plan), diffusers' own Ulysses through the model's ``_cp_plan``
(``ulysses_degree=N``; how it runs without an accelerator: ``bench.diffusers_cp``)
and the unmodified model on one process. Per method: all-to-alls and their bytes
per transformer layer and every other collective of the forward (rank 0,
``CommAccounting``), and the max |difference| from the one-process outputs
(every output: LTX-2's and MiniMax-H3's video and audio) over the ranks. A model
whose Ulysses diffusers cannot run at the shape, or that we refuse, gets a row
saying why. No timing. The tables go to stdout and to ``--out`` (default
``bench_out/``) as ``cp_plan_models_n{N}.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dsp_plugin.spawn import spawn

__all__ = ["MODELS", "NOT_BENCHED", "QUICK", "SHAPES", "cp_plan_classes", "main", "markdown", "measure"]

#: label -> (``dsp_plugin.testing.tiny_video`` case, diffusers class); 2 transformer layers each
MODELS = {"Wan": ("tiny-wan", "WanTransformer3DModel"),
          "ChronoEdit": ("tiny-chronoedit", "ChronoEditTransformer3DModel"),
          "Helios": ("tiny-helios", "HeliosTransformer3DModel"),
          "LTX-Video": ("tiny-ltx-video", "LTXVideoTransformer3DModel"),
          "LTX-2": ("tiny-ltx2", "LTX2VideoTransformer3DModel"),
          "MiniMax-H3": ("tiny-minimax-h3", "MiniMaxH3Transformer3DModel"),
          "Flux": ("tiny-flux", "FluxTransformer2DModel")}  # 1 double- and 1 single-stream block: 2 layers
#: the builders' shape per model: 4 heads, 4 latent frames of 8x8 (4x4 = 16 patches a frame: 64 video tokens, whole
#: frames on 2 and 4 ranks); what else diffusers splits divisible by 4: the text of LTX-Video and LTX-2 (8 tokens),
#: MiniMax-H3's packed rows (6 text + 64 video + 6 audio); Helios: its 3 new frames (48 tokens) after 20 of history
SHAPES = {label: {"heads": 4, "size": 8, "frames": 4} for label in MODELS} | {
    "Helios": {"heads": 4, "size": 8}, "LTX-Video": {"heads": 4, "size": 8, "frames": 4, "text": 8},
    "LTX-2": {"heads": 4, "size": 8, "frames": 4, "text": 8},
    "MiniMax-H3": {"heads": 4, "size": 8, "frames": 4, "text": 6},
    "Flux": {"heads": 4, "size": 8, "text": 8}}  # 8x8 image tokens (packed latents) and 8 text tokens
#: the smallest (the test; N=2 only): 2 heads, 2 latent frames of 4x4 (2x2 patches a frame: 8 video tokens), text 4
#: where split (MiniMax-H3: 4 + 8 + 6 rows; Flux: 4x4 image tokens); Helios as above (at 4x4 its 17 tokens with
#: history do not split in two)
QUICK = {label: {"heads": 2, "size": 4, "frames": 2} for label in MODELS} | {
    "Helios": {"heads": 2, "size": 8}, "LTX-Video": {"heads": 2, "size": 4, "frames": 2, "text": 4},
    "LTX-2": {"heads": 2, "size": 4, "frames": 2, "text": 4},
    "MiniMax-H3": {"heads": 2, "size": 4, "frames": 2, "text": 4}, "Flux": {"heads": 2, "size": 4, "text": 4}}
#: rows without a model run: (what we do, what diffusers does)
NOT_BENCHED = {"Cosmos 3": ("refused by parallelize (plan/builtin/refused.py: two pathways in one attention call on "
                            "a packed sequence, grouped K/V heads)",
                            "no `_cp_plan` on Cosmos3OmniTransformer: its CP is an external helper "
                            "(examples/cosmos3/cosmos_parallel.py), not `enable_parallelism`")}


def cp_plan_classes() -> list[str]:
    """The transformer classes of the installed diffusers that declare a ``_cp_plan`` (imports every transformer)."""
    import importlib
    import pkgutil

    from diffusers.models import transformers

    found = set()
    for info in pkgutil.iter_modules(transformers.__path__):
        try:
            module = importlib.import_module(f"{transformers.__name__}.{info.name}")
        except ImportError:  # an optional dependency missing: that module's models cannot run here anyway
            continue
        for name, cls in vars(module).items():
            if isinstance(cls, type) and cls.__module__ == module.__name__ and vars(cls).get("_cp_plan"):
                found.add(name)
    return sorted(found)


def _splits(model: Any) -> tuple[dict[str, int], list[Any]]:
    """Hooks recording, in the model's next forward, the length of every tensor its ``_cp_plan`` splits (each must
    divide by N for diffusers' equal chunks), by ``"path key"``; returns the dict it fills and the hooks' handles."""
    import inspect

    from diffusers.models._modeling_parallel import ContextParallelInput

    lengths: dict[str, int] = {}

    def keep(where: str, spec: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.dim() == spec.expected_dims:
            lengths[where] = value.shape[spec.split_dim]

    handles = []
    for path, entry in model._cp_plan.items():
        try:
            module = model.get_submodule(path.replace("*", "0"))
        except AttributeError:  # a module this model lacks (Helios' plan names 40 layers)
            continue
        for key, spec in (entry.items() if isinstance(entry, dict) else ()):
            if not isinstance(spec, ContextParallelInput):
                continue
            where = f"{path or 'forward'} {key}"
            if spec.split_output:
                handles.append(module.register_forward_hook(
                    lambda m, a, out, where=where, spec=spec, key=key: keep(where, spec, out[key])))
            else:
                def pre(m: Any, args: Any, kwargs: Any, where: str = where, spec: Any = spec, key: Any = key) -> None:
                    bound = inspect.signature(m.forward).bind_partial(*args, **kwargs).arguments
                    keep(where, spec, bound.get(key))
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return lengths, handles


def _refusal(heads: int, lengths: dict[str, int], n: int) -> str | None:
    from dsp_plugin.bench.diffusers_cp import refusal

    for where, length in lengths.items():
        why = refusal(heads, length, n)
        if why is not None:
            return why.replace("tokens", f"rows of {where}")
    return None


def _one(label: str, n: int, dtype: torch.dtype, shape: dict[str, int]) -> dict[str, Any]:
    import dsp_plugin
    from dsp_plugin.bench import diffusers_cp
    from dsp_plugin.plan.builtin import BY_CLASS
    from dsp_plugin.testing.tiny_video import case

    reference, kwargs = case(MODELS[label][0], dtype, **shape)

    def forward(model: Any) -> Any:
        return lambda: [o for o in model(**kwargs, return_dict=False) if isinstance(o, torch.Tensor)]

    lengths, hooks = _splits(reference)
    with torch.no_grad():
        expected = forward(reference)()
    for hook in hooks:
        hook.remove()
    layers = sum(len(getattr(reference, name, ())) for name in ("blocks", "transformer_blocks",
                                                                "single_transformer_blocks"))
    plan = "built-in plan" if type(reference).__name__ in BY_CLASS else "plan derived from its `_cp_plan`"
    row: dict[str, Any] = {"plan": plan, "layers": layers, "heads": shape["heads"], "lengths": lengths,
                           "outputs": [list(e.shape) for e in expected]}
    try:
        ours = dsp_plugin.parallelize(copy.deepcopy(reference))
    except ValueError as exc:  # a refusal: the same on every rank, before any collective
        row["ours_refused"] = str(exc)
    else:
        try:  # a refusal in the forward (a shape check: equal shapes on every rank, so every rank raises it)
            row["ours"] = diffusers_cp.account(forward(ours), expected)
        except ValueError as exc:
            row["ours_refused"] = f"fails: ValueError: {str(exc).splitlines()[0]}"
    why = _refusal(shape["heads"], lengths, n)
    if why is not None:
        row["diffusers_refused"] = why
        return row
    theirs = copy.deepcopy(reference)
    try:
        row["diffusers_how"] = diffusers_cp.enable_ulysses(theirs, n)
    except ValueError as exc:  # raised while registering its hooks, the same on every rank, before any collective
        row["diffusers_refused"] = f"cannot run: {exc}"
        cut = _cut(reference)  # Helios: its plan names blocks 0-39; the plan of the blocks this model has
        if cut is not None:
            theirs = copy.deepcopy(reference)
            diffusers_cp.enable_ulysses(theirs, n, cut)
            row["diffusers_cut"] = diffusers_cp.account(forward(theirs), expected)
        return row
    try:  # its shape checks: the same on every rank (equal shapes), so every rank leaves at the same collective
        row["diffusers"] = diffusers_cp.account(forward(theirs), expected)
    except (RuntimeError, AssertionError) as exc:
        row["diffusers_refused"] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return row


def _cut(model: Any) -> dict[str, Any] | None:
    """``model._cp_plan`` without the entries naming modules the model does not have, or None if it has them all."""
    def present(path: str) -> bool:
        try:
            model.get_submodule(path)
        except AttributeError:
            return False
        return True

    plan = model._cp_plan
    cut = {path: spec for path, spec in plan.items() if "*" in path or present(path)}
    return cut if len(cut) < len(plan) else None


def measure(rank: int, n: int, labels: list[str], quick: bool = False, dtype: str = "float64") -> dict[str, Any]:
    """On every rank of a world of ``n`` (``spawn``'s, the tests' pool): each model of ``labels`` three ways, at
    ``QUICK`` or ``SHAPES``; this rank's counts, bytes and max differences (``combine`` takes rank 0's and the max)."""
    from dsp_plugin.bench import diffusers_cp

    diffusers_cp.prepare_rank()
    shapes = QUICK if quick else SHAPES
    return {label: _one(label, n, getattr(torch, dtype), shapes[label]) for label in labels}


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's counts and bytes, the max difference over the ranks."""
    rows = copy.deepcopy(per_rank[0])
    for label, row in rows.items():
        for method in ("ours", "diffusers", "diffusers_cut"):
            if method in row:
                row[method]["max_diff"] = max(r[label][method]["max_diff"] for r in per_rank)
    return rows


def _other(r: dict[str, Any]) -> str:
    ops = {op: v for op, v in r["ops"].items() if op != "all_to_all"}
    return ", ".join(f"{c} {op} ({b:,})" for op, (c, b) in ops.items()) or "none"


def markdown(rows: dict[str, Any], n: int, *, dtype: str = "float64", classes: list[str] | None = None) -> str:
    """One table: a row per (model, method); the models not run (``NOT_BENCHED``, ``classes`` not in ``MODELS``)."""
    import diffusers

    from dsp_plugin.bench.diffusers_cp import WHY

    lines = [f"N={n} gloo ranks, CPU, {dtype}; one forward (no grad); counts and bytes sent by rank 0, per "
             "transformer layer for the all-to-alls, for the whole forward for the others; max |difference| from "
             "the unmodified model on one process over the ranks and every output.", "",
             "| model | method | all-to-alls per layer | all-to-all bytes per layer (rank 0) | other collectives "
             "(bytes) | max abs diff vs one process |", "| --- | --- | --- | --- | --- | --- |"]
    for label, row in rows.items():
        layers = row["layers"]
        shape = (f"{label} ({MODELS[label][1]}; {layers} layers, {row['heads']} heads; diffusers splits "
                 + " and ".join(map(str, sorted(set(row["lengths"].values())))) + " rows)")
        for method, name in (("ours", f"dsp_plugin.parallelize ({row['plan']})"),
                             ("diffusers", f"diffusers {diffusers.__version__} Ulysses (`_cp_plan`)"),
                             ("diffusers_cut", "diffusers Ulysses, `_cp_plan` cut to the model's layers")):
            r = row.get(method)
            if r is None and method == "diffusers_cut":
                continue
            if r is None:
                lines.append(f"| {shape} | {name} | - | {row[f'{method}_refused']} | - | - |")
                continue
            lines.append(f"| {shape} | {name} | {r['all_to_all'] / layers:g} | {r['a2a_bytes'] // layers:,} | "
                         f"{_other(r)} | {r['max_diff']:.1e} |")
    for label, (ours, theirs) in NOT_BENCHED.items():
        lines.append(f"| {label} | dsp_plugin.parallelize | - | {ours} | - | - |")
        lines.append(f"| {label} | diffusers Ulysses | - | {theirs} | - | - |")
    known = {cls for _, cls in MODELS.values()}
    for cls in classes or []:
        if cls not in known:
            lines.append(f"| {cls} | both | - | not benched here: no tiny builder in dsp_plugin.testing (an image "
                         "model with joint attention, as Flux) | - | - |")
    lines += ["", f"diffusers' side: its own code, unpatched: {WHY}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsp_plugin.bench.cp_plan_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--quick", action="store_true", help="the smallest shapes (2 heads: --nproc 2 only)")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (default bench_out/)")
    args = parser.parse_args(argv)
    print(f"[bench] cp_plan models: ours and diffusers' Ulysses on {args.nproc} ranks", file=sys.stderr, flush=True)
    per_rank = spawn(measure, args.nproc, list(MODELS), args.quick, args.dtype, timeout=900, collective_timeout_s=120)
    rows = combine(per_rank)
    table = markdown(rows, args.nproc, dtype=args.dtype, classes=cp_plan_classes())
    print(table, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cp_plan_models_n{args.nproc}"
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print(f"[bench] wrote {stem}.md, {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
