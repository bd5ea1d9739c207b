"""``parallelize``: apply a plan to a model with hooks; the model keeps its signature and its parameters.

One forward of a parallelized model:

- the model's own pre-hook opens a *frame* (this thread's record of the forward:
  the global grid from the plan's ``Grid`` and the axis currently sharded);
- ``Split`` hooks cut a replicated activation (partial adjoint, no communication)
  and tag it with the carrier's ``ShardSpec``;
- a ``Block`` reads its activation's placement from the tag (or, after the
  model's own reshapes dropped it, from the frame), switches only if it attends
  the sharded axis, splits its per-row conditioning with the activation, and
  switches its output when the model's reshapes after it need another placement;
- a ``Heads`` module attends through the head switch (``dsp_plugin.plan.heads``);
- ``Gather`` hooks all-gather, and the model's replicated outputs get 1/N of the
  gradient (``dsp_plugin.plan.ops``), so every parameter's gradient summed over the
  group is the one-process gradient (the project's convention).

The schedule is static: where each switch goes is fixed by the plan, and which
placement a block sees is the same on every rank and in every forward. Under
activation checkpointing a recomputed block finds its placement on its input's
tag, so no frame is needed in backward.
"""

from __future__ import annotations

import inspect
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsp_plugin.comm import group_size
from dsp_plugin.plan import ops, recompute
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

__all__ = ["apply_plan", "expand", "sharded_io"]

_local = threading.local()
_GRID_ATTR = "_dsp_plan_grid"


@dataclass
class _Frame:
    owner: int
    grid: dict[str, int] = field(default_factory=dict)
    shard: str | None = None
    sharded_io: bool = False


class sharded_io:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Feed the parallelized models called in this block (this thread) shards, and get shards back.

    ``with sharded_io(F=frames, HW=h * w): out = model(local_latents, ...)``: the
    keyword arguments are the global lengths of the sharded axis and of the axes
    folded with it (a full tensor, such as a positional table, is told from a
    shard by its length). A ``Split`` whose
    input is already this rank's shard only tags it, ``Gather`` keeps the shard,
    ``Positions`` modules see the global shape. For sampling loops that keep the
    latents sharded from the first step to the last.
    """

    def __init__(self, **axes: int) -> None:
        self.axes = {k: int(v) for k, v in axes.items()}

    def __enter__(self) -> sharded_io:
        _frames().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _frames().remove(self)


def _sharded_io() -> sharded_io | None:
    return next((f for f in reversed(_frames()) if isinstance(f, sharded_io)), None)


def _frames() -> list[Any]:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


def expand(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, nn.Module, list[Any]]]:
    """``[(path, module, specs)]`` in the model's module order; ``*`` matches any one path component."""
    names = dict(model.named_modules())
    found: dict[str, list[Any]] = {}
    for pattern, specs in plan.items():
        specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in names if regex.match(n)]
        if not hits:
            raise ValueError(f"plan: {pattern!r} matches no module of {type(model).__name__}")
        for spec in specs:
            if isinstance(spec, Grid) and pattern != "":
                raise ValueError(f"plan: Grid belongs to the model itself (path ''), not {pattern!r}")
            if not isinstance(spec, (Block, Gather, Grid, Heads, Positions, Split)):
                raise TypeError(f"plan: {pattern!r} has {spec!r}; expected Split, Block, Heads, Gather or Grid")
        for n in hits:
            found.setdefault(n, []).extend(specs)
    return [(n, names[n], found[n]) for n in names if n in found]


class _Args:
    """A module call's arguments by name (``inspect.signature`` of its forward)."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.sig = inspect.signature(module.forward)
        self.bound = self.sig.bind_partial(*args, **kwargs)

    def name(self, arg: str | int) -> str:
        return list(self.sig.parameters)[arg] if isinstance(arg, int) else arg

    def get(self, arg: str | int) -> Any:
        return self.bound.arguments.get(self.name(arg))

    def set(self, arg: str | int, value: Any) -> None:
        self.bound.arguments[self.name(arg)] = value

    def out(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(self.bound.args), dict(self.bound.kwargs)


def _map_tensors(out: Any, fn: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_map_tensors(o, fn) for o in out)
    if isinstance(out, dict):  # diffusers' BaseOutput is an OrderedDict that mirrors attributes
        for k in list(out.keys()):
            out[k] = _map_tensors(out[k], fn)
        return out
    return out


class _Runtime:
    def __init__(self, model: nn.Module, plan: dict[str, Any], group: Any) -> None:
        self.model, self.group = model, group
        self.entries = expand(model, plan)
        self.grid = next((s for _, _, specs in self.entries for s in specs if isinstance(s, Grid)), Grid())
        self.handles: list[Any] = []

    # -- frames ---------------------------------------------------------------
    def frame(self) -> _Frame | None:
        for f in reversed(_frames()):
            if isinstance(f, _Frame) and f.owner == id(self):
                return f
        return None

    def root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recompute.forward_starts()  # kept collective outputs belong to one forward (plan/recompute.py)
        a = _Args(module, args, kwargs)
        io = _sharded_io()
        if io is not None:
            _frames().append(_Frame(id(self), dict(io.axes), sharded_io=True))
            return
        grid = {}
        for axis, (name, dim) in self.grid.axes.items():
            value = a.get(name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"parallelize: the plan's Grid reads {axis} from argument {name!r}, which is "
                                 f"{type(value).__name__}; expected a tensor")
            grid[axis] = value.shape[dim]
        _frames().append(_Frame(id(self), grid))

    def root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        frames = _frames()
        frame = self.frame()
        if frame is not None:
            frames.remove(frame)
        if output is None or (frame is not None and frame.sharded_io):
            return output
        n = group_size(self.group)
        return _map_tensors(output, lambda t: ops.scale_grad(t, 1.0 / n))

    # -- per-module hooks -----------------------------------------------------
    def pre(self, path: str, specs: list[Any]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            a = _Args(module, args, kwargs)
            for spec in specs:
                if isinstance(spec, Split) and spec.arg != "out":
                    value, where = a.get(spec.arg), f"{path}: Split({spec.arg!r})"
                    if isinstance(value, tuple):  # a pair of tables (RoPE's cos, sin): each split alike
                        a.set(spec.arg, tuple(self.split(where, t, spec) for t in value))
                    elif value is not None:  # an optional input the caller left out stays out
                        a.set(spec.arg, self.split(where, value, spec))
                elif isinstance(spec, Block):
                    self.block_pre(path, a, spec)
                elif isinstance(spec, Heads):
                    from dsp_plugin.plan.heads import enter_heads

                    enter_heads(path, self.group, spec.joint)
                elif isinstance(spec, Gather) and spec.arg != "out":
                    a.set(spec.arg, self.gather(f"{path}: Gather({spec.arg!r})", a.get(spec.arg), spec))
                elif isinstance(spec, Positions):
                    frame = self.frame()
                    x = a.get(spec.arg)
                    if frame is not None and frame.sharded_io and isinstance(x, torch.Tensor):
                        shape = [frame.grid[spec.dims[d]] if d in spec.dims else x.shape[d] for d in range(x.dim())]
                        a.set(spec.arg, x.new_zeros(()).expand(shape))  # the global shape, no memory
            return a.out()

        return hook

    def post(self, path: str, specs: list[Any]):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            for spec in reversed(specs):
                if isinstance(spec, Heads):
                    from dsp_plugin.plan.heads import exit_heads

                    exit_heads()
                elif isinstance(spec, Block):
                    output = self.block_post(path, spec, output)
                elif output is None:
                    continue
                elif isinstance(spec, Split) and spec.arg == "out":
                    output = _map_tensors(output, lambda t, s=spec: self.split(f"{path}: Split('out')", t, s))
                elif isinstance(spec, Gather) and spec.arg == "out":
                    output = _map_tensors(output, lambda t, s=spec: self.gather(f"{path}: Gather('out')", t, s))
            return output

        return hook

    def split(self, where: str, x: Any, spec: Split) -> Any:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{where}: expected a tensor to split, got {type(x).__name__}")
        frame = self.frame()
        if frame is not None and frame.sharded_io and not _is_full(x, spec, frame.grid):  # already a shard
            grid = ops.infer_grid(where, x, spec.layout, frame.grid, shard=spec.shard, group=self.group)
            frame.grid, frame.shard = grid, spec.shard
            return ops.tag(x, spec.layout, grid, spec.shard)
        # a recompute under activation checkpointing runs this hook again on the same input, in backward,
        # where no frame is open: the grid is kept on the replicated input itself
        known = frame.grid if frame is not None else getattr(x, _GRID_ATTR, {})
        grid = ops.infer_grid(where, x, spec.layout, known)
        setattr(x, _GRID_ATTR, grid)
        if frame is not None:
            frame.grid, frame.shard = grid, spec.shard
        return ops.plan_split(where, x, spec.layout, grid, spec.shard, self.group)

    def gather(self, where: str, x: Any, spec: Gather) -> Any:
        frame = self.frame()
        placed = ops.read_spec(x, spec.layout) if isinstance(x, torch.Tensor) else None
        if placed is None and (frame is None or frame.shard is None):
            raise ValueError(f"{where}: the input carries no shard tag and no forward of this model is in "
                             f"progress; expected a sharded activation")
        grid, shard = placed if placed is not None else (frame.grid, frame.shard)
        if frame is not None and frame.sharded_io:  # the caller wants the shard back
            return ops.tag(x, spec.layout, grid, shard)
        if frame is not None:
            frame.shard = None
        return ops.plan_gather(where, x, spec.layout, grid, shard, self.group)

    def block_pre(self, path: str, a: _Args, spec: Block) -> None:
        x = a.get(spec.arg)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{path}: the block's activation {a.name(spec.arg)!r} is {type(x).__name__}; "
                             f"expected a tensor (set Block.arg)")
        frame = self.frame()
        placed = ops.read_spec(x, spec.layout)
        if placed is None:
            if frame is None or frame.shard is None:
                raise ValueError(f"{path}: the activation carries no shard tag and no forward of this model "
                                 f"is in progress; expected a Split before this block")
            placed = (frame.grid, frame.shard)
            x = ops.tag(x, spec.layout, *placed)  # so a recompute finds the placement on its input
        grid, shard = placed
        if spec.attends is not None and spec.attends == shard:
            if spec.then is None:
                raise ValueError(f"{path}: the block attends {shard!r}, the sharded axis; set Block.then to "
                                 f"the axis to switch to")
            x = ops.plan_switch(path, x, spec.layout, grid, shard, spec.then, self.group)
            shard = spec.then
        a.set(spec.arg, x)
        for name, rows in spec.follow.items():
            c = a.get(name)
            if isinstance(c, torch.Tensor) and shard in rows.dims[0]:
                a.set(name, _split_rows(f"{path}: follow {name!r}", c, rows, grid, shard, self.group))
        _frames().append(("block", spec, grid, shard))

    def block_post(self, path: str, spec: Block, output: Any) -> Any:
        frames = _frames()
        entry = next((f for f in reversed(frames) if isinstance(f, tuple) and f[1] is spec), None)
        if entry is None:
            return output
        frames.remove(entry)
        _, _, grid, shard = entry
        if output is None:
            return None
        first = output[0] if isinstance(output, tuple) else output
        if spec.out_shard is not None and spec.out_shard != shard:
            first = ops.plan_switch(path, first, spec.layout, grid, shard, spec.out_shard, self.group, tail=True)
            shard = spec.out_shard
        else:
            first = ops.tag(first, spec.layout, grid, shard)
        frame = self.frame()
        if frame is not None:
            frame.grid, frame.shard = grid, shard
        return (first, *output[1:]) if isinstance(output, tuple) else first


def _is_full(x: torch.Tensor, spec: Split, grid: dict[str, int]) -> bool:
    """Under ``sharded_io``: is ``x`` the full tensor (a positional table built for the global grid)?"""
    dim = spec.layout.dim_of(spec.shard)
    names = spec.layout.dims[dim]
    if any(a not in grid for a in names):
        return False
    full = 1
    for a in names:
        full *= grid[a]
    return x.dim() > dim and x.shape[dim] == full


def current_block() -> tuple[dict[str, int], str, Any] | None:
    """(grid, sharded axis, layout) of the innermost block running on this thread."""
    for f in reversed(_frames()):
        if isinstance(f, tuple) and f[0] == "block":
            return f[2], f[3], f[1].layout
    return None


def _split_rows(where: str, c: torch.Tensor, rows: Any, grid: dict[str, int], shard: str, group: Any) -> Any:
    names = rows.dims[0]
    lengths = [grid[a] for a in names]
    if c.shape[0] != int(torch.tensor(lengths).prod()):
        raise ValueError(f"{where}: {c.shape[0]} rows, expected {' * '.join(names)} = {lengths}")
    u = c.reshape(*lengths, *c.shape[1:])
    local = ops.partial_split(where, u, names.index(shard), group)
    return local.reshape(-1, *c.shape[1:])


def apply_plan(model: nn.Module, plan: dict[str, Any], group: Any = None) -> nn.Module:
    """Register ``plan``'s hooks on ``model`` (in place) and return it."""
    if getattr(model, "_dsp_plan_runtime", None) is not None or getattr(model, "_dsp_hooks", None):
        raise ValueError("parallelize: this model is already parallelized")
    rt = _Runtime(model, plan, group)
    rt.handles.append(model.register_forward_pre_hook(rt.root_pre, with_kwargs=True))
    for path, module, specs in rt.entries:
        specs = [s for s in specs if not isinstance(s, Grid)]
        if not specs:
            continue
        rt.handles.append(module.register_forward_pre_hook(rt.pre(path, specs), with_kwargs=True))
        rt.handles.append(module.register_forward_hook(rt.post(path, specs), with_kwargs=True, always_call=True))
    # the model's own post-hook last: it closes the frame after every module hook ran
    rt.handles.append(model.register_forward_hook(rt.root_post, with_kwargs=True, always_call=True))
    model._dsp_plan_runtime = rt
    return model
