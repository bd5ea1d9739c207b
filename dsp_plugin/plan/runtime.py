"""``parallelize``: apply a plan to a model with hooks; the model keeps its signature and its parameters.

One forward of a parallelized model:

- the model's own pre-hook opens a *frame* (this thread's record of the forward:
  the global grid from the plan's ``Grid`` and the axis currently sharded;
  ``dsp_plugin.plan.frames``, with ``sharded_io`` and ``OnShard``);
- ``Split`` hooks cut a replicated activation (partial adjoint, no communication)
  and tag it with the carrier's ``ShardSpec``;
- a ``Block`` reads its activation's placement from the tag (or, after the
  model's own reshapes dropped it, from the frame), switches only if it attends
  the sharded axis, splits its per-row conditioning with the activation, and
  switches its output when the model's reshapes after it need another placement;
- a ``Heads`` module attends through the head switch (``dsp_plugin.plan.attention``);
- ``Gather`` hooks all-gather, and the model's replicated outputs get 1/N of the
  gradient (``dsp_plugin.plan.ops``), so every parameter's gradient summed over the
  group is the one-process gradient (the project's convention).

The schedule is static: where each switch goes is fixed by the plan, and which
placement a block sees is the same on every rank and in every forward. Under
activation checkpointing a recomputed block finds its placement on its input's
tag (the lengths of the axes folded with the sharded one, and an ``OnShard``'s
decision, are kept on the same input object), so no frame is needed in backward.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin import checks, every_gradient, failures
from dsp_plugin import layout as carrier
from dsp_plugin.comm import agree_inputs, group_rank, group_size
from dsp_plugin.comm.group_resolution import _place, _resolve_group
from dsp_plugin.plan import dispatch, ops, projections, recompute
from dsp_plugin.plan.args import Args as _Args
from dsp_plugin.plan.args import expand, known_places
from dsp_plugin.plan.args import map_tensors as _map_tensors
from dsp_plugin.plan.attention import EmptyShardMode, enter_heads, exit_heads
from dsp_plugin.plan.compiled_entry import check_compiled_inputs
from dsp_plugin.plan.frames import (
    Frame,
    OnShard,
    close_frame,
    current_block,
    current_frame,
    current_io,
    frames,
    open_frame,
    sharded_io,
)
from dsp_plugin.plan.moves import Moves
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split
from dsp_plugin.plan.wrap import still_wrapped, wrap

__all__ = ["INPUT_HINT", "apply_plan", "current_block", "expand", "remove_plan", "sharded_io"]

#: what a parallelized model's input mismatch (``checks.InputMismatch``) tells the user to do
INPUT_HINT = ("Seed every rank alike before drawing inputs (torch.manual_seed, or a torch.Generator with the same "
              "seed), give the ranks of a DSP group the same batches (dsp_plugin.dsp_dataloader), or, when the "
              "inputs are this rank's shards on purpose, call the model under dsp_plugin.plan.sharded_io.")

# a process group's ranks, for check_inputs' signature (fixed for the group's life; the group held weakly)
_RANKS: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()

_UNSEEN = object()  # a Heads module not known to attend through diffusers' dispatch alone


class _Runtime(Moves):
    def __init__(self, model: nn.Module, plan: dict[str, Any], group: Any, comm_dtype: object = None) -> None:
        self.model, self.plan, self.group = model, plan, group
        self.comm_dtype = comm_dtype  # the switches' wire format (comm/payload.py); a Block/Heads may opt out
        self.entries = expand(model, plan)
        self.places = self.find_places()  # path ("" the model) -> known_places of its module, for its hooks' _Args
        # Heads module path -> its attention processor, for modules seen attending through diffusers' dispatch
        # alone (``_learn``): their calls run without the SDPA level
        self.via_dispatch: dict[str, Any] = {}
        self.heads = any(isinstance(s, Heads) for _, _, specs in self.entries for s in specs)
        self.grid = next((s for _, _, specs in self.entries for s in specs if isinstance(s, Grid)), Grid())
        self.splits: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # split_plan's: (site, shape, ...) -> plan
        self.tag_placed: dict[str, tuple[Any, ...]] = {}  # placed's: block/gather site -> (tag, shape, placement)
        self.handles: list[Any] = []
        self.forwards: list[tuple[str, nn.Module, Any]] = []  # (path, module, its plan.wrap.Forward)
        # Heads module path -> the layout of the pass-through block it runs in (``bypass``: that block's hooks
        # may be left out of a call; the Heads call reads the placement from the frame then)
        self.in_passing: dict[str, Any] = _passing_heads(self.entries)

    def find_places(self) -> dict[str, Any]:
        return {"": known_places(self.model)} | {path: known_places(module) for path, module, _ in self.entries}

    # -- frames ---------------------------------------------------------------
    def frame(self) -> Frame | None:
        return current_frame(self)

    def members(self, frame: Frame | None) -> tuple[int, int]:
        """The plan's group: (size, this rank's place), as resolved for the forward in progress (``frame``), or
        now (a recompute under activation checkpointing runs without a frame)."""
        if frame is not None and frame.members is not None:
            return frame.members
        return group_size(self.group), group_rank(self.group)

    def root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recompute.forward_starts()  # kept collective outputs belong to one forward (plan/recompute.py)
        compiling = torch.compiler.is_compiling()  # asked once per forward
        if self.heads and not compiling:
            # a diffusers backend registered after parallelize is wrapped too. Not while tracing: comparing the
            # registry with what install left there puts a guard on every backend and constraint (~390 on the
            # tiny Wan), evaluated at every compiled call. A backend registered between parallelize and a compiled
            # call is refused there (exit_heads; so it was with install traced: dynamo applies the registry's
            # update only after a whole graph) and wrapped by the next eager call
            dispatch.install()
        if not compiling:  # a module forward replaced since parallelize is wrapped again (plan/wrap.py)
            for path, hooked, wrapper in self.forwards:
                if hooked.__dict__.get("forward") is not wrapper:
                    still_wrapped(hooked, wrapper, path)
        a = _Args(module, args, kwargs, self.places.get(""))
        io = current_io()
        group = _resolve_group(self.group, "parallelize")  # once per forward: the hooks read the frame's members
        members = (1, 0) if group is None else _place(group)  # (group_size, group_rank) of the resolved group
        always = not compiling and checks.check_mode() == "always"  # compiled: no SDPA level
        if io is not None:
            open_frame(Frame(self, dict(io.axes), sharded_io=True, handling=sys.exc_info()[1],
                             members=members, check_always=always))
            return
        if not any(isinstance(f, Frame) for f in frames()):  # replicated inputs (not a model inside another's)
            self.check_inputs(module, a, group, compiling)
        grid = {}
        for axis, (name, dim) in self.grid.axes.items():
            value = a.get(name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"parallelize: the plan's Grid reads {axis} from argument {name!r}, which is "
                                 f"{type(value).__name__}; expected a tensor")
            grid[axis] = value.shape[dim]
        open_frame(Frame(self, grid, handling=sys.exc_info()[1], members=members, check_always=always))

    def check_inputs(self, module: nn.Module, a: _Args, group: Any, compiling: bool) -> None:
        """Every rank was given the same inputs (``agree_inputs``), when ``checks`` says so: by default once per
        signature, recognized from the call's own arguments without binding them (``inspect``, on every forward).
        Traced: an op of the graph, which checks at every compiled call (plan/compiled_entry.py)."""
        if group is None or not dist.is_initialized():
            return  # one process: nothing to agree (agree_inputs returns at once too)
        name = f"parallelize({type(module).__name__})"
        if compiling:
            return check_compiled_inputs(name, a.passed(), group, hint=INPUT_HINT)
        try:
            ranks = _RANKS.get(group)
        except TypeError:  # not weak-referenceable (torch's NON_GROUP_MEMBER sentinel): asked, not kept
            ranks = tuple(dist.get_process_group_ranks(group))
        if ranks is None:
            ranks = _RANKS[group] = tuple(dist.get_process_group_ranks(group))
        seen = ("plan inputs", name, ranks, _signature_of(a.args), _signature_of(a.kwargs))
        if not checks.needs_check_for(seen):
            return
        agree_inputs(name, dict(a.bound.arguments), group=group, hint=INPUT_HINT)
        checks.remember(seen)

    def root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        frame = self.frame()
        if frame is not None:
            close_frame(frame)
        error = sys.exc_info()[1]   # always called: the forward raised on this rank (maybe alone)
        if error is not None and (frame is None or error is not frame.handling):
            failures.post(error)    # before its process exits, for the peers waiting in a collective
            return output
        if output is None or (frame is not None and frame.sharded_io):
            return output
        n = self.members(frame)[0]
        return _map_tensors(output, lambda t: ops.scale_grad(t, 1.0 / n))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save`` of a whole parallelized model) without what the hooks keep across forwards."""
        return {k: v for k, v in self.__dict__.items() if k not in ("splits", "tag_placed", "places")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.splits, self.tag_placed = {}, {}
        self.places = self.find_places()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Runtime:
        """The runtime of a deep copy of the model (an EMA copy): the copy's modules, the same plan and group.

        The hooks are ``_Hook`` objects holding their runtime, so copying the model's hook dicts
        copies them onto this runtime; the plan's specs are immutable and the process group is shared.
        """
        new = _Runtime.__new__(_Runtime)
        memo[id(self)] = new
        new.plan, new.group, new.grid, new.comm_dtype = self.plan, self.group, self.grid, self.comm_dtype
        new.via_dispatch, new.heads = {}, self.heads  # the copy's modules have their own processors: learnt again
        new.in_passing = self.in_passing  # paths and the plan's layouts: the same in the copy
        new.splits, new.tag_placed = {}, {}  # the copy's own
        new.model = copy.deepcopy(self.model, memo)
        new.entries = [(path, copy.deepcopy(module, memo), specs) for path, module, specs in self.entries]
        new.places = new.find_places()
        new.handles = copy.deepcopy(self.handles, memo)
        new.forwards = copy.deepcopy(self.forwards, memo)
        return new

    # -- per-module hooks -----------------------------------------------------
    def pre(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        a = _Args(module, args, kwargs, self.places.get(path))  # bound on first use: a Heads-only hook binds nothing
        originals = {spec.arg: a.get(spec.arg) for spec in specs if isinstance(spec, OnShard)}
        block: dict[str, Any] | None = None
        for spec in specs:
            if isinstance(spec, Split) and spec.arg != "out":
                where = f"{path}: Split({spec.arg!r})"
                try:
                    value = a.get(spec.arg)
                except ValueError as exc:  # a path into something that is not a tuple
                    raise ValueError(f"{where}: {exc}") from None
                if isinstance(value, (tuple, list)):  # RoPE's (cos, sin), Allegro's nested tables: each leaf
                    a.set(spec.arg, _map_tensors(value, lambda t, w=where, s=spec: self.split(w, t, s)))
                elif value is not None:  # an optional input the caller left out stays out
                    a.set(spec.arg, self.split(where, value, spec))
            elif isinstance(spec, Block):
                block = self.block_pre(path, a, spec)
            elif isinstance(spec, Heads):
                self.heads_enter(path, spec, module)
            elif isinstance(spec, Gather) and spec.arg != "out":
                a.set(spec.arg, self.gather(f"{path}: Gather({spec.arg!r})", a.get(spec.arg), spec))
            elif isinstance(spec, OnShard):
                self.on_shard(path, a, spec, originals[spec.arg])
            elif isinstance(spec, Positions):
                frame = self.frame()
                x = a.get(spec.arg) if frame is not None and frame.sharded_io else None
                if isinstance(x, torch.Tensor):
                    shape = [frame.grid[spec.dims[d]] if d in spec.dims else x.shape[d] for d in range(x.dim())]
                    a.set(spec.arg, x.new_zeros(()).expand(shape))  # the global shape, no memory
        if block is not None and block["empty"] and not any(isinstance(spec, Heads) for spec in specs):
            block["mode"] = EmptyShardMode()   # entered last, left first (block_post): the mode stack's order
            block["mode"].__enter__()
        return a.out() if a.changed else None  # None: the call's own arguments

    def post(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             output: Any) -> Any:
        # inside out, whatever the plan's order: the head switch's call closes, then the block (which tags
        # its activation), then the module's output is split or gathered
        error: Exception | None = None
        for spec in reversed(specs):
            if isinstance(spec, Heads):
                error = self.heads_exit(path, module)  # raised after the other specs closed what they opened
        for spec in reversed(specs):
            if isinstance(spec, Block):
                output = self.block_post(path, spec, output)
        for spec in specs:
            if output is None:
                break
            if isinstance(spec, Split) and spec.arg == "out":
                output = _map_tensors(output, lambda t, s=spec: self.split(f"{path}: Split('out')", t, s))
            elif isinstance(spec, Gather) and spec.arg == "out":
                output = self.gather_out(f"{path}: Gather('out')", output, spec)
        if error is not None:
            raise error
        return output

    def heads_enter(self, path: str, spec: Heads, module: nn.Module) -> None:
        frame = self.frame()
        io = (frame.io_shard, frame.masks) if frame is not None and frame.sharded_io else None
        compiling = torch.compiler.is_compiling()
        # the SDPA level (never under torch.compile: enter_heads): unless the module is known to attend
        # through diffusers' dispatch alone (``_learn``); DSP_CHECK=1: at every call
        sdpa = not compiling and (
            self.via_dispatch.get(path, _UNSEEN) is not getattr(module, "processor", None)
            or (frame.check_always if frame is not None else checks.check_mode() == "always"))
        block = None
        layout = self.in_passing.get(path)
        if layout is not None and frame is not None and frame.passing is not None and frame.passing[0] is layout \
                and not compiling:
            # its block ran without hooks (``bypass``) if no block of this forward is open: the frame's placement
            for f in reversed(frames()):
                if f is frame:
                    block = (frame.grid, frame.shard, layout)
                if f is frame or isinstance(f, tuple):
                    break
        enter_heads(path, self.group, spec.joint, comm_dtype=self.comm_dtype, exact=spec.exact, io=io,
                    sdpa=sdpa, members=self.members(frame), block=block)

    def heads_exit(self, path: str, module: nn.Module) -> RuntimeError | None:
        """Close the module's ``Heads`` call; its refusal (no attention intercepted) is returned, not raised."""
        try:
            call = exit_heads()
        except RuntimeError as exc:
            self.via_dispatch.pop(path, None)
            return exc
        self._learn(path, module, call)
        return None

    # a module whose only spec is ``Heads`` (every attention of a full-3D model): its hooks without the loops
    def heads_pre(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
        self.heads_enter(path, specs[0], module)

    def heads_post(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any], output: Any) -> Any:
        error = self.heads_exit(path, module)
        if error is not None:
            raise error
        return output

    # a module whose only spec is ``Block`` (every block of a model): the same, without the loops
    def block_only_pre(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        a = _Args(module, args, kwargs, self.places.get(path))
        block = self.block_pre(path, a, specs[0])
        if block["empty"]:
            block["mode"] = EmptyShardMode()  # as in ``pre``
            block["mode"].__enter__()
        return a.out() if a.changed else None

    def block_only_post(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], output: Any) -> Any:
        return self.block_post(path, specs[0], output)

    def bypass(self, path: str, specs: list[Any], module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """The tag to leave on its output where a call of a pass-through block (``_passing_heads``) can run
        without its hooks, else None: in a forward without autograd (no recompute will look for its input's tag)
        whose frame holds the placement a block of the same layout handed on (``Frame.passing``), when its input
        carries that block's tag or none (the hooks would read the frame then too). Its hooks would only read that
        placement, tag the output with it (``bypass_finish``) and give it to its ``Heads`` modules, which read it
        from the frame instead (``heads_enter``). Not under DSP_CHECK=1."""
        if torch.is_grad_enabled():
            return None
        frame = current_frame(self)
        if frame is None or frame.passing is None or frame.passing[0] is not specs[0].layout or frame.check_always:
            return None
        x = _Args(module, args, kwargs, self.places.get(path)).get(specs[0].arg)  # as block_pre reads it
        if not isinstance(x, torch.Tensor):
            return None  # the hooks say what is wrong with it
        own = getattr(x, carrier.TAG_ATTR, None)
        return frame.passing[1] if own is None or own is frame.passing[1] else None

    def bypass_finish(self, output: Any, tag: Any) -> Any:
        """A bypassed block's output tagged as ``block_post`` tags it (the input's placement, its tag)."""
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor):
            carrier.attach_spec(first, tag)
        return output

    def _learn(self, path: str, module: nn.Module, call: Any) -> None:
        """After a ``Heads`` call: whether the module attends through diffusers' dispatch alone.

        The SDPA level (a ``TorchFunctionMode``: a Python call for every torch op of the module, ~40 a Wan
        attention) is needed only by a module that calls ``scaled_dot_product_attention`` itself. A module whose
        call attended through diffusers' dispatch and never through SDPA is called without it while its
        attention processor is the same object (``set_attn_processor`` puts a new one: watched again). Should
        such a call then attend neither way, ``exit_heads`` refuses it on every rank, and the next call is watched.
        Under ``DSP_CHECK=1`` every call is watched.
        """
        if call is None or torch.compiler.is_compiling():
            return
        if call.attended and not call.via_sdpa:
            self.via_dispatch[path] = getattr(module, "processor", None)
        elif call.via_sdpa:
            self.via_dispatch.pop(path, None)

class _Hook:
    """One module's plan hook: ``runtime.pre`` or ``runtime.post`` for ``path``'s specs.

    An object, not a closure, so ``copy.deepcopy`` of the model (an EMA copy) gives the copy's
    modules hooks on the copy's runtime (``_Runtime.__deepcopy__``); a closure would be shared
    and run the copy's modules in the original's frames.
    """

    def __init__(self, runtime: _Runtime, kind: str, path: str, specs: list[Any]) -> None:
        self.runtime, self.kind, self.path, self.specs = runtime, kind, path, specs
        only = specs[0] if len(specs) == 1 and kind != "bypass" else None  # one spec: its own hook, no loops
        prefix = "heads_" if isinstance(only, Heads) else "block_only_" if isinstance(only, Block) else ""
        self.fn = getattr(runtime, prefix + kind)

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        return self.fn(self.path, self.specs, module, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return _Hook(copy.deepcopy(self.runtime, memo), self.kind, self.path, self.specs)

    def finish(self, output: Any, token: Any) -> Any:
        """After a call ``runtime.bypass`` let run without the hooks (``plan.wrap.Forward``)."""
        return self.runtime.bypass_finish(output, token)


def apply_plan(model: nn.Module, plan: dict[str, Any], group: Any = None, *, comm_dtype: object = None) -> nn.Module:
    """Register ``plan``'s hooks on ``model`` (in place) and return it."""
    if getattr(model, "_dsp_plan_runtime", None) is not None:
        raise ValueError("parallelize: this model is already parallelized")
    from dsp_plugin.comm.payload import as_payload

    rt = _Runtime(model, plan, group, as_payload("parallelize", comm_dtype))
    heads = [path for path, _, specs in rt.entries if any(isinstance(s, Heads) for s in specs)]
    if heads:  # the head switch at diffusers' attention dispatch too (plan/dispatch.py)
        dispatch.check_model(model, heads)
        dispatch.install()
    for path, module, specs in rt.entries:  # attention a module computes itself: switched at its projections
        for spec in specs:
            if isinstance(spec, Heads) and spec.qkv is not None:
                rt.handles.extend(projections.install(path, module, spec))
    rt.handles.append(model.register_forward_pre_hook(rt.root_pre, with_kwargs=True))
    for path, module, specs in rt.entries:
        specs = [s for s in specs if not isinstance(s, Grid)]
        if not specs:
            continue
        # only the hooks that act, around the module's forward (plan/wrap.py: not torch's hooks, whose dispatch
        # costs every hooked module call more than the hooks themselves)
        pre = _Hook(rt, "pre", path, specs) if any(_acts_before(s) for s in specs) else None
        post = _Hook(rt, "post", path, specs) if any(_acts_after(s) for s in specs) else None
        handle = wrap(module, pre, post, _Hook(rt, "bypass", path, specs) if _passes_through(specs) else None)
        rt.handles.append(handle)
        rt.forwards.append((path, module, handle.wrapper))
    # the model's own post-hook last: it closes the frame after every module hook ran
    rt.handles.append(model.register_forward_hook(rt.root_post, with_kwargs=True, always_call=True))
    # a parameter some ranks use and others not gets a (zero) gradient on every rank (DDP, ZeRO)
    rt.handles.extend(every_gradient.install(model, group=functools.partial(_gradient_group, group)))
    model._dsp_plan_runtime = rt
    return model


def _passes_through(specs: list[Any]) -> bool:
    """A module planned as a ``Block`` alone that neither switches nor splits anything with its activation: its
    hooks hand the placement on (``_Runtime.bypass``)."""
    return len(specs) == 1 and isinstance(specs[0], Block) and specs[0].attends is None and \
        specs[0].out_shard is None and not specs[0].follow and not specs[0].local and not specs[0].refuse


def _passing_heads(entries: list[tuple[str, nn.Module, list[Any]]]) -> dict[str, Any]:
    """{path of a ``Heads`` module: the layout of its block}, for each whose innermost planned ``Block`` around it
    passes through (``_passes_through``)."""
    blocks = {path: specs for path, _, specs in entries if any(isinstance(s, Block) for s in specs)}
    found = {}
    for path, _, specs in entries:
        if not any(isinstance(s, Heads) for s in specs) or path in blocks:
            continue
        parts = path.split(".")
        outer = next((".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1) if ".".join(parts[:i]) in blocks),
                     None)
        block = [s for s in blocks[outer] if not isinstance(s, Grid)] if outer is not None else []
        if _passes_through(block):
            found[path] = block[0].layout
    return found


def _acts_before(spec: Any) -> bool:
    """Whether ``spec`` does something in its module's pre-hook (``_Runtime.pre``)."""
    return isinstance(spec, (Block, Heads, OnShard, Positions)) or (
        isinstance(spec, (Split, Gather)) and spec.arg != "out")


def _acts_after(spec: Any) -> bool:
    """Whether ``spec`` does something in its module's post-hook (``_Runtime.post``): a ``Split`` or ``Gather`` of
    an input acts before the call only, ``Positions`` and ``OnShard`` too."""
    return isinstance(spec, (Block, Heads)) or (isinstance(spec, (Split, Gather)) and spec.arg == "out")


def _signature_of(value: object) -> object:
    """What ``check_inputs`` recognizes a call's arguments by: tensors' shapes and dtypes, containers' layout, other
    values' types (``agree_inputs`` compares the values themselves, when the signature is new)."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    if isinstance(value, (list, tuple)):
        return tuple([_signature_of(v) for v in value])
    if isinstance(value, dict):
        return tuple([(k, _signature_of(v)) for k, v in value.items()])
    return type(value)


def _gradient_group(group: Any) -> Any:
    """The ranks whose frameworks reduce this model's gradients: the plan's group if given, else the
    installed topology's DP x DSP group (else the DSP group of ``group=None``, which refuses without one)."""
    if group is not None:
        return group
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    if topology is not None and topology.dp_dsp_group is not None:
        return topology.dp_dsp_group
    return _resolve_group(None, "parallelize")


def remove_plan(model: nn.Module) -> nn.Module:
    """Undo ``apply_plan``: remove the plan's hooks from ``model`` (in place) and return it."""
    rt = getattr(model, "_dsp_plan_runtime", None)
    if rt is None:
        raise ValueError(f"remove_plan: {type(model).__name__} is not parallelized by a plan")
    for handle in rt.handles:
        handle.remove()
    del model._dsp_plan_runtime
    return model
