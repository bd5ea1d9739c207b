"""One forward and backward of a model under a plan against the same model on one process, per planned module.

Each rank runs the model twice: the reference, left alone (the one-process
computation, repeated on every rank with no collective), and a deep copy
parallelized with the plan; both on the same batch with the same fixed
weighted-sum loss. Per call of each planned module, every tensor of its output
(tuples, lists, dicts, diffusers' output classes) is compared with the
reference's tensor of the same name restricted to this rank's part, and so is
its gradient in backward (``dsp_plugin.check.outputs``). The gradients of each module's
parameters, summed over the group (``reduce_gradients``, the project's
convention), are compared with the reference's, and so are the model's outputs
and the input gradients (partial per rank: summed).

Collectives are counted by ``CommAccounting`` and attributed to the innermost
planned module in progress: in forward, the module whose call (its plan hooks
included) issued the collective; in backward, the module whose call created the
autograd node that issues it (autograd's sequence numbers). The sums of inputs
and gradients after backward are outside the measured region.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.check.outputs import (
    Element,
    Placed,
    difference,
    largest,
    named_tensors,
    part_of,
    place_output,
    sum_replicated_grads,
)
from dsp_plugin.comm import group_rank, group_size, reduce_gradients
from dsp_plugin.comm.collectives import all_reduce_sum
from dsp_plugin.plan.args import expand, tensors
from dsp_plugin.plan.spec import Block, Grid

__all__ = ["Element", "ModuleResult", "Result", "compare", "resolve_plan"]

ROOT = "(model)"  # collectives issued outside every planned module


@dataclass
class ModuleResult:
    """One planned module: its specs, calls, collectives ``{op: [count, bytes sent]}`` and differences."""

    path: str
    specs: str
    calls: int = 0
    forward: dict[str, list[int]] = field(default_factory=dict)
    backward: dict[str, list[int]] = field(default_factory=dict)
    elements: list[Element] = field(default_factory=list)  # every tensor of its output, over its calls
    grad_diff: float | None = None  # max |summed gradient - reference gradient| over the module's parameters
    grad_scale: float = 0.0
    note: str = ""
    finished: int = -1  # the order in which its first call finished (forward): an inner module before its parent

    def element(self, name: str) -> Element:
        found = next((e for e in self.elements if e.name == name), None)
        if found is None:
            found = Element(name)
            self.elements.append(found)
        return found


@dataclass
class Result:
    modules: list[ModuleResult]
    out_diff: float = 0.0
    out_scale: float = 0.0
    input_grad_diff: float = 0.0
    input_grad_scale: float = 0.0
    grad_diff: float = 0.0
    grad_scale: float = 0.0
    outside: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # phase -> collectives outside modules
    notes: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # floating dtypes of the model's parameters and buffers
    dtype_mode: str = ""  # set by the checker: float64, float32 or model (its own dtypes)
    dtype_note: str = ""  # set by the checker: why the model was checked in its own dtypes


def resolve_plan(model: nn.Module, plan: Any) -> dict[str, Any]:
    """``plan`` as a dict: None is the model's built-in plan (``builtin_plan``), a function is called with it."""
    from dsp_plugin.plan.builtin import builtin_plan

    resolved = builtin_plan(model) if plan is None else plan(model) if callable(plan) else plan
    if resolved is None:
        raise ValueError(f"no plan given and no built-in plan for {type(model).__name__}; expected --plan")
    if not isinstance(resolved, dict):
        raise TypeError(f"the plan is a {type(resolved).__name__}; expected a dict {{module path: spec}}")
    return resolved


class _Tracker(TorchDispatchMode):
    """Which planned module is in progress, for each collective ``CommAccounting`` records beneath this mode."""

    def __init__(self, acct: CommAccounting) -> None:
        super().__init__()
        self.acct, self.stack, self.owner = acct, [], []
        self.spans: list[tuple[int, int, str]] = []  # (first, end) autograd sequence numbers of a module call
        self.open: list[int] = []

    def enter(self, path: str) -> None:
        self.stack.append(path)
        self.open.append(torch._C._autograd._get_sequence_nr())

    def leave(self) -> None:
        self.spans.append((self.open.pop(), torch._C._autograd._get_sequence_nr(), self.stack.pop()))

    def current(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:  # forward
            return self.stack[-1] if self.stack else ROOT
        seq = node._sequence_nr()
        inside = [(end - first, path) for first, end, path in self.spans if first <= seq < end]
        return min(inside)[1] if inside else ROOT

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        before = len(self.acct.records)
        out = func(*args, **(kwargs or {}))  # CommAccounting's mode, beneath this one, records it
        self.owner.extend([self.current()] * (len(self.acct.records) - before))
        return out


def _dsp_group(group: Any) -> Any:
    if group is not None:
        return group
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    return None if topology is None else topology.dsp_group


def _loss(out: Any, seed: int) -> torch.Tensor:
    """A fixed weighted sum of every floating-point output tensor (the same weights on every rank)."""
    g = torch.Generator().manual_seed(seed)
    total = None
    for t in tensors(out):
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
            total = (t * w).sum() if total is None else total + (t * w).sum()
    if total is None:
        raise ValueError("the model's output holds no floating-point tensor that requires grad; expected one "
                         "to run backward on")
    return total


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], list[Any]]:
    """Fresh copies of the inputs; the floating-point tensors among them require grad (returned as leaves),
    except keyword arguments named ``*mask*`` (models take integer views of their masks: ``mask.sum(dtype=int)``)."""
    leaves: list[torch.Tensor] = []

    def fresh(v: Any, name: str = "") -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and "mask" not in name:
            leaves.append(v.detach().clone().requires_grad_(True))
            return leaves[-1]
        return v

    return tuple(fresh(a) for a in args), {k: fresh(v, k) for k, v in kwargs.items()}, leaves




def compare(reference: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], plan: Any = None, *,
            group: Any = None, seed: int = 0) -> Result:
    """Run ``reference`` and a copy parallelized with ``plan`` on this rank (see the module docstring).

    ``plan``: a dict, a function of the model, or None (the built-in plan); ``group``: the DSP group (None: the
    installed topology's, over which ``reduce_gradients`` sums too). Every rank must pass the same model and
    inputs.
    """
    from dsp_plugin.plan import parallelize

    model = copy.deepcopy(reference)
    plan = resolve_plan(model, plan)
    n, rank = group_size(group), group_rank(group)
    entries = [(p, m, [s for s in specs if not isinstance(s, Grid)]) for p, m, specs in expand(model, plan)]
    rows = {p: ModuleResult(p, ", ".join(type(s).__name__ for s in specs) or "Grid") for p, _, specs in entries}
    ref_outs: dict[str, list[dict[str, Placed]]] = {p: [] for p in rows}
    outs: dict[str, list[list[Placed]]] = {p: [] for p in rows}
    order: list[str] = []
    handles = []

    def keep_grads(output: Any, placed: list[Placed]) -> None:
        for (_, t), p in zip(named_tensors(output), placed):
            if t.requires_grad:
                t.register_hook(lambda g, p=p: setattr(p, "grad", None if g is None else g.detach()))

    ref_modules = dict(reference.named_modules())
    for path in rows:
        def keep(m: nn.Module, a: Any, o: Any, p: str = path) -> None:
            placed = [Placed(name, t.detach(), None) for name, t in named_tensors(o)]
            keep_grads(o, placed)
            ref_outs[p].append({e.name: e for e in placed})

        handles.append(ref_modules[path].register_forward_hook(keep))
    parallelize(model, plan, group)
    acct = CommAccounting(activations=False)
    tracker = _Tracker(acct)
    for path, module, specs in entries:
        block_layout = next((s.layout for s in specs if isinstance(s, Block)), None)

        def pre(m: nn.Module, a: Any, p: str = path) -> None:
            tracker.enter(p)
            if p not in order:
                order.append(p)

        def post(m: nn.Module, a: Any, o: Any, p: str = path, lay: Any = block_layout) -> None:
            placed = place_output(o, lay)
            keep_grads(o, placed)
            outs[p].append(placed)
            if rows[p].finished < 0:
                rows[p].finished = sum(r.finished >= 0 for r in rows.values())
            tracker.leave()

        # outside the plan's own hooks: before its pre-hook, after its post-hook
        handles.append(module.register_forward_pre_hook(pre, prepend=True))
        handles.append(module.register_forward_hook(post, always_call=True))

    results = []
    for m in (reference, model):
        a, kw, leaves = _inputs(args, kwargs)
        if m is model:
            with acct, tracker:
                out = m(*a, **kw)
                _loss(out, seed + 1).backward()
        else:
            out = m(*a, **kw)
            _loss(out, seed + 1).backward()
        results.append(([t.detach() for t in tensors(out)], leaves))
    for h in handles:
        h.remove()

    (out_ref, in_ref), (out_par, in_par) = results
    result = Result([])
    held = [*reference.parameters(), *reference.buffers()]
    result.dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in held if t.is_floating_point()})
    result.out_diff = max((difference(a, b) for a, b in zip(out_par, out_ref)), default=0.0)
    result.out_scale = max((largest(b) for b in out_ref), default=0.0)
    for x, r in zip(in_par, in_ref):
        if (x.grad is None) != (r.grad is None):
            result.notes.append(f"an input's gradient is {'missing' if x.grad is None else 'extra'} under the plan")
        elif x.grad is not None:
            all_reduce_sum(x.grad, group=_dsp_group(group))  # each rank's input gradient is its partial
            result.input_grad_diff = max(result.input_grad_diff, difference(x.grad, r.grad))
            result.input_grad_scale = max(result.input_grad_scale, largest(r.grad))
    reduce_gradients(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    grads = {k: (p.grad, ref_params[k].grad) for k, p in model.named_parameters()}
    for k, (g, r) in grads.items():
        if (g is None) != (r is None):
            result.notes.append(f"parameter {k}: gradient {'missing' if g is None else 'extra'} under the plan")
    pairs = {k: v for k, v in grads.items() if v[0] is not None and v[1] is not None}
    result.grad_diff = max((difference(g, r) for g, r in pairs.values()), default=0.0)
    result.grad_scale = max((largest(r) for _, r in pairs.values()), default=0.0)

    backward = _compare_outputs(rows, outs, ref_outs, n, rank)
    note = sum_replicated_grads([(p, r.tensor) for _, p, r in backward], n, _dsp_group(group))
    if note:
        result.notes.append(note)
    _compare_output_grads(backward, n, rank)
    for path, row in rows.items():
        prefix = "" if path == "" else path + "."
        own = [v for k, v in pairs.items() if k.startswith(prefix)]
        if own:
            row.grad_diff = max(difference(g, r) for g, r in own)
            row.grad_scale = max(largest(r) for _, r in own)
    for record, owner in zip(acct.records, tracker.owner):
        if owner in rows:
            bucket = getattr(rows[owner], record.phase)
        else:
            bucket = result.outside.setdefault(record.phase, {})
        entry = bucket.setdefault(record.op, [0, 0])
        entry[0] += 1
        entry[1] += max(record.bytes_sent, 0)
    result.modules = [rows[p] for p in order] + [rows[p] for p in rows if p not in order]
    return result


def _compare_outputs(rows: dict[str, ModuleResult], outs: dict[str, list[list[Placed]]],
                     ref_outs: dict[str, list[dict[str, Placed]]], n: int,
                     rank: int) -> list[tuple[Element, Placed, Placed]]:
    """Every output tensor of every call against the reference's (forward); returns what backward compares: the
    placed tensors of every module but the model itself (its output's gradient is the loss's weights)."""
    backward = []
    for path, row in rows.items():
        row.calls = len(outs[path])
        if row.calls != len(ref_outs[path]):
            row.note = f"called {row.calls} times, {len(ref_outs[path])} on one process"
        for call, ref_call in zip(outs[path], ref_outs[path]):
            for name in ref_call.keys() - {p.name for p in call}:
                row.element(name).note = "missing under the plan"
            for p in call:
                element, r = row.element(p.name), ref_call.get(p.name)
                if r is None:
                    element.note = "not in the one-process output"
                    continue
                element.out_scale = max(element.out_scale, largest(r.tensor))
                part = part_of(r.tensor, p.tensor, p.spec, n, rank)
                if part is None:
                    element.note = element.note or (f"shape {tuple(p.tensor.shape)} is not placed against "
                                                     f"{tuple(r.tensor.shape)}: not compared")
                    continue
                element.out_diff = max(element.out_diff or 0.0, difference(p.tensor, part))
                if path != "":
                    backward.append((element, p, r))
    return backward


def _compare_output_grads(backward: list[tuple[Element, Placed, Placed]], n: int, rank: int) -> None:
    """Each output tensor's gradient against the reference's part of it (replicated ones summed already)."""
    for element, p, r in backward:
        if p.grad is None and r.grad is None:
            continue
        mine = p.grad if p.grad is not None else torch.zeros_like(p.tensor)
        ref = r.grad if r.grad is not None else torch.zeros_like(r.tensor)
        part = part_of(ref, mine, p.spec, n, rank)
        if part is None:
            element.note = element.note or f"gradient of shape {tuple(mine.shape)} is not placed: not compared"
            continue
        element.grad_scale = max(element.grad_scale, largest(ref))
        element.grad_diff = max(element.grad_diff or 0.0, difference(mine, part))
