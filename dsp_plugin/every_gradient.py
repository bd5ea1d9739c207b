"""A missing gradient counts as zeros: every rank gets a gradient for a parameter some rank used.

Under DSP a parameter may be used on some ranks only: a CLS or register token added to the
frame one rank holds, a head run on one rank's shard, an adapter reading ``emb.cls_token``
as an attribute (outside ``emb``'s own forward, which never runs) on the rank that owns
frame 0. On the other ranks it gets no gradient, and each framework's reduction breaks
its own way: torch DDP waits for it forever, ZeRO-1/2/3 flatten buckets of different sizes
(gloo: "Received data size doesn't match expected size", SIGABRT) or, when the sizes happen
to match, sum mismatched slots. ``reduce_gradients`` copes with a missing gradient by
itself; the frameworks need one on every rank.

How, whichever way the parameter is used (inside or outside its module's forward):

1. The first forward with gradients enabled *learns* which trainable parameters this rank
   uses: those a ``TorchFunctionMode`` sees an op make a tensor of, and those the output's
   autograd graph reaches (a use inside a custom autograd Function, such as ZeRO-3's linear,
   is seen by no mode). At the forward's end the group sums the flags (one all_reduce of one
   int per parameter). A parameter some but not
   all ranks used is *rank-dependent* (under ZeRO, so is one no rank used: it needs a gradient too).
2. In that forward, every trainable parameter hangs on one identity node (``_Touch``) on the
   model's first floating-point input; its backward, which runs after every other node of
   the model's backward, returns zeros for the rank-dependent parameters and nothing for the
   rest (a parameter no rank used keeps ``grad is None``, as on one process).
3. Later forwards hang only the rank-dependent parameters there.

A ZeRO-3 parameter partitioned at the model's input (not persistent, not gathered) is left out:
an edge to it would fix its empty shape as its gradient's; such a parameter is gathered by its
own module, on every rank alike, so it cannot be rank-dependent unless read as an attribute,
which DeepSpeed gathers on the reading ranks only (docs/deepspeed.md).

On the model's *input*, not beside the use: a rank-dependent parameter's gradient is then
complete at the same point of every rank's backward (the end), so ZeRO fills its buckets
in the same order everywhere; a parameter used by every rank gets no term and no delay.
``DSP_CHECK=1`` re-learns in every forward (a use that changes mid-run); ``DSP_CHECK=0``
still learns once (this is correctness, not a check). Cost: the first forward runs under
the mode (a Python call per op) and one all_reduce; later forwards one autograd node and,
per backward, one zero tensor per rank-dependent parameter.

Under torch.compile the learning forward's hooks run outside dynamo (``_Eager``: a host read and a
collective), so a fresh model's first call may be the compiled one, ``fullgraph=True`` included; its ops run
in compiled graphs, which no mode sees, so the parameters it uses are those the output's graph reaches (the
compiled graphs' autograd nodes have an edge to each parameter they read).

Installed by ``dsp_plugin.parallelize`` (over the plan's group, or the topology's DP x DSP
group) and by ``dsp_plugin.deepspeed.initialize`` (over DP x DSP, after DeepSpeed's hooks).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from dsp_plugin import checks
from dsp_plugin.comm.collectives import all_reduce_sum

__all__ = ["install", "remove"]

_ATTR = "_dsp_every_gradient"


class _Uses(TorchFunctionMode):
    """Notes which of ``index``'s parameters any op reads (this thread, while entered)."""

    def __init__(self, index: dict[int, int]) -> None:
        super().__init__()
        self.index, self.used, self.entered = index, [0] * len(index), False

    def leave(self) -> None:
        if self.entered:
            self.entered = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an op that makes a tensor of it, under no_grad too (the forward of a reentrant checkpoint, whose
        # graph is built again in backward); not a metadata query (numel) nor an attribute (``.data``, which
        # ZeRO-3 reads and sets on every parameter it gathers or frees)
        if getattr(func, "__name__", "") not in ("__get__", "__set__") and \
                any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            for leaf in tree_leaves((args, kwargs)):
                i = self.index.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if i is not None:
                    self.used[i] = 1
        return out

    def reached(self, output: Any) -> None:
        """Also count the parameters the output's graph reaches: uses inside custom autograd Functions
        (ZeRO-3's linear, fused kernels), which no function mode sees. Not through ``_Touch``'s own edges."""
        stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if variable is not None:
                i = self.index.get(id(variable))
                if i is not None:
                    self.used[i] = 1
            edges = node.next_functions[:1] if type(node) is _Touch._backward_cls else node.next_functions
            stack.extend(next_node for next_node, _ in edges)


class _Touch(torch.autograd.Function):
    """Identity on ``x`` (a view); backward also hands parameter ``i`` of ``hung`` zeros if ``state`` marks it late."""

    @staticmethod
    def forward(ctx, x, state, hung, *params):  # type: ignore[override]
        ctx.state, ctx.specs = state, [(i, p.shape, p.dtype, p.device) for i, p in zip(hung, params)]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # differentiable again (a gradient penalty): the identity and constant zeros
        late = ctx.state.late or set()
        zeros = [torch.zeros(shape, dtype=dtype, device=device) if i in late else None
                 for i, shape, dtype, device in ctx.specs]
        return (grad, None, None, *zeros)


class _State:
    def __init__(self, params: list[torch.nn.Parameter], group: Any, unused: bool) -> None:
        self.group = group    # a process group, or a function returning one (resolved at the forward)
        self.params, self.unused = params, unused
        self.index = {id(p): i for i, p in enumerate(params)}
        self.late: set[int] | None = None   # indices of the rank-dependent parameters; None: not learned yet
        self.mode: _Uses | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _State:
        """A deep copy of the model (an EMA copy) keeps what was learned, on its own parameters."""
        new = _State([copy.deepcopy(p, memo) for p in self.params], self.group, self.unused)
        new.late = None if self.late is None else set(self.late)
        return new

    def resolved(self) -> Any:
        return self.group() if callable(self.group) else self.group

    def learns(self) -> bool:
        """Whether the next forward learns (its hooks run eagerly then, ``_Eager``)."""
        return self.late is None or checks.check_mode() == "always"

    def before(self, model: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.params or _size(self.resolved()) == 1:
            return None
        compiling = torch.compiler.is_compiling()  # traced: learned already (else ``_Eager`` runs this)
        if self.late is None and not compiling and \
                any(is_fake(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            self.late = set()  # the dry run (python -m dsp_plugin.dryrun) models a steady step: no learning forward, no values
        learn = self.late is None or (not compiling and checks.check_mode() == "always")
        hung = list(range(len(self.params))) if learn else sorted(self.late)  # type: ignore[arg-type]
        if learn and self.mode is None:
            self.mode = _Uses(self.index)
            if not _compiled(model):  # a compiled forward's ops are seen by no mode: its graph tells (``reached``)
                self.mode.__enter__()
                self.mode.entered = True
        hung = [i for i in hung if _whole(self.params[i])]
        if not hung:
            return None
        hung_on = _hang((args, kwargs), lambda x: _Touch.apply(x, self, hung, *(self.params[j] for j in hung)))
        return hung_on   # None: no floating-point input, nothing to hang the term on (docs/api.md)

    def after(self, model: torch.nn.Module, args: Any, output: Any) -> None:
        """The forward returned: agree on what each rank used (one all_reduce), then stop learning."""
        mode, self.mode = self.mode, None
        if mode is None:
            return
        mode.leave()
        mode.reached(output)
        group = self.resolved()
        counts = torch.tensor(mode.used, dtype=torch.int64)
        with checks.exchanging():  # agreement, like the checks' exchanges: kept out of the model's traffic counts
            all_reduce_sum(counts, group=group)
        if is_fake(counts):  # the dry run under DSP_CHECK=always: nothing to read
            return
        n = _size(group)
        if dist.get_backend(group) == "fake":  # a fake world (dsp_plugin.fake_world): the sum is rank 0's own
            counts = counts * n  # flags, and rank 0 stands for every rank (else every used parameter looks late)
        self.late = {i for i, c in enumerate(counts.tolist()) if (self.unused or c > 0) and c < n}

    def cleanup(self, *_: Any) -> None:
        """Always called: after a forward that raised, leave the mode (nothing learned, no collective)."""
        if self.mode is not None:
            self.mode.leave()
            self.mode = None


class _Eager:
    """A hook of a learning forward, run outside torch.compile's tracing: it reads values on the host and sends a
    collective, which no graph can hold. Called from torch's module call, not from traced code (``torch.compile
    (model)`` and ``model.compile()`` run a model's own hooks outside dynamo), it is no graph break; traced with
    the forward (``wrap_top_frame``, a model called in a compiled function) it is one, whose reason says so. Once
    nothing is left to learn, the hook itself takes its place (``_settle``): traced from then on, as before."""

    def __init__(self, hook: Any, state: _State) -> None:
        self.hook, self.state = hook, state

    def __call__(self, *args: Any) -> Any:  # ``torch.compiler.disable``d at the first ``install``
        try:
            return self.hook(*args)
        finally:
            if not self.state.learns():
                _settle(args[0], self.state)


_TRACED_REASON = ("dsp_plugin: a parallelized model's first forward learns on the host which parameters each rank "
                  "uses (dsp_plugin/every_gradient.py), outside the graph; where the model's hooks are traced with "
                  "its forward (wrap_top_frame, a model called in a compiled function) the compiled code keeps the "
                  "model's hooks as frames of their own, as torch.compile(model) has them. For one graph, run one "
                  "eager forward before compiling")


def _disable_tracing() -> None:
    """``_Eager.__call__`` out of dynamo's reach, once (imports torch._dynamo; diffusers imports it too)."""
    if getattr(_Eager.__call__, "_dsp_disabled", False):
        return
    try:
        call = torch.compiler.disable(_Eager.__call__, reason=_TRACED_REASON)
    except TypeError:  # torch < 2.8: no reason
        call = torch.compiler.disable(_Eager.__call__)
    call._dsp_disabled = True
    _Eager.__call__ = call  # type: ignore[method-assign]


def _compiled(model: torch.nn.Module) -> bool:
    """Whether this forward of ``model`` runs compiled (``torch.compile(model)``, ``model.compile()``)."""
    in_optimized = getattr(torch._dynamo.eval_frame, "_is_in_optimized_module", None)
    return getattr(model, "_compiled_call_impl", None) is not None or (in_optimized is not None and in_optimized())


def _settle(model: torch.nn.Module, state: _State) -> None:
    """``state``'s hooks on ``model`` as themselves, no longer ``_Eager`` (same places: the hook order stays)."""
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for key, hook in list(hooks.items()):
            if type(hook) is _Eager and hook.state is state:
                hooks[key] = hook.hook


def _hang(value: Any, touch: Any) -> Any:
    """``value`` with ``touch`` applied to its first floating-point tensor (in pytree's order, through tuples, lists
    and dicts, which dynamo traces, unlike pytree's unflatten); None if it has none."""
    if isinstance(value, torch.Tensor):
        return touch(value) if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            hung = _hang(item, touch)
            if hung is not None:
                items = [*value[:i], hung, *value[i + 1:]]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif isinstance(value, dict):
        for key, item in value.items():
            hung = _hang(item, touch)
            if hung is not None:
                return {**value, key: hung} if type(value) is dict else type(value)({**value, key: hung})
    return None


def _whole(p: torch.nn.Parameter) -> bool:
    """Not a ZeRO-3 parameter partitioned right now: an edge to it would record its empty shape for good."""
    return getattr(p, "ds_numel", p.numel()) == p.numel()


def _size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def remove(model: torch.nn.Module) -> None:
    """Take ``install``'s hooks off ``model`` and every submodule."""
    for module in model.modules():
        for handle in module.__dict__.pop(_ATTR, []):
            handle.remove()


def install(model: torch.nn.Module, *, group: Any, unused: bool = False) -> list[RemovableHandle]:
    """Give every rank of ``group`` a gradient for each parameter of ``model`` some rank used (module docstring).

    ``unused=True``: also for the parameters no rank used (ZeRO needs a gradient for each; without
    it such a parameter keeps ``grad is None``, as on one process, which ``reduce_gradients`` expects).

    Replaces an earlier installation on ``model`` or any submodule (``initialize`` over a
    parallelized model keeps one). ``group``: the ranks whose frameworks reduce the gradients
    (DDP's or ZeRO's group; the DSP group at least), or a function returning it at the forward.
    """
    remove(model)
    _disable_tracing()
    state = _State([p for p in model.parameters() if p.requires_grad], group, unused)
    # after the model's other pre-hooks: ZeRO-3 gathers the model's own and external parameters in its
    # own (installed by initialize before this); a plan's Split of the model's input made its shard,
    # whose tag the view below keeps (``layout.shard_spec`` finds it on the same view of the same memory)
    handles = [model.register_forward_pre_hook(_Eager(state.before, state), with_kwargs=True),
               model.register_forward_hook(_Eager(state.after, state)),
               model.register_forward_hook(_Eager(state.cleanup, state), always_call=True)]
    model.__dict__[_ATTR] = handles
    return handles
