"""The plan vocabulary: what a plan says about one module of a model.

A plan maps module paths (``model.get_submodule`` names; ``*`` matches any
ModuleList index, ``""`` is the model itself) to one spec or a list of specs:

=================  =====================================================================
``Grid``           (root only) global axis lengths read from the model's own inputs
``Split``          R -> S: an input (or the output) of the module is split on one axis
``Block``          the activation of a block: which axis it attends (a switch is inserted
                   before it only when that axis is the sharded one), the placement its
                   output must leave with, per-row conditioning that follows the shard
``Heads``          full attention inside the module runs through the head switch
``Gather``         S -> R: an input (or the output) of the module is gathered
``Positions``      the module computes positional tables from an input's *shape* (RoPE);
                   when the model is fed shards (``sharded_io``) it sees the global shape
=================  =====================================================================

Layouts name the axes of a tensor, one group per tensor dim: ``"(B T) S D"`` is a
tensor ``[B*T, S, D]`` whose dim 0 folds B and T row-major (Latte's spatial
blocks), ``"B S D"`` a flat token sequence (Wan). Only the named sequence axes
(those in the plan's ``Grid`` or found at the split) are ever sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Block", "Gather", "Grid", "Heads", "Layout", "Positions", "Split"]


@dataclass(frozen=True)
class Layout:
    """A parsed layout: ``dims[i]`` is the tuple of axis names folded into tensor dim ``i``."""

    dims: tuple[tuple[str, ...], ...]

    @staticmethod
    def parse(text: str) -> Layout:
        dims: list[tuple[str, ...]] = []
        group: list[str] | None = None
        for token in text.replace("(", " ( ").replace(")", " ) ").split():
            if token == "(":
                if group is not None:
                    raise ValueError(f"layout {text!r}: nested parentheses")
                group = []
            elif token == ")":
                if not group:
                    raise ValueError(f"layout {text!r}: empty or unopened group")
                dims.append(tuple(group))
                group = None
            elif group is not None:
                group.append(token)
            else:
                dims.append((token,))
        if group is not None:
            raise ValueError(f"layout {text!r}: unclosed '('")
        names = [a for d in dims for a in d]
        if len(set(names)) != len(names):
            raise ValueError(f"layout {text!r}: an axis name appears twice")
        return Layout(tuple(dims))

    def __post_init__(self) -> None:  # looked up by every hook: computed once (neither is compared or hashed)
        object.__setattr__(self, "axes", tuple(a for d in self.dims for a in d))
        object.__setattr__(self, "_dims_of", {a: i for i, d in enumerate(self.dims) for a in d})

    axes: tuple[str, ...] = field(init=False, repr=False, compare=False)  # every axis name, in order

    def dim_of(self, axis: str) -> int:
        dim = self._dims_of.get(axis)
        if dim is None:
            raise ValueError(f"axis {axis!r} is not in layout {self}")
        return dim

    def __str__(self) -> str:
        return " ".join(d[0] if len(d) == 1 else "(" + " ".join(d) + ")" for d in self.dims)


def _layout(text: str | Layout) -> Layout:
    return text if isinstance(text, Layout) else Layout.parse(text)


@dataclass(frozen=True)
class Grid:
    """Global axis lengths read from the model's inputs: ``Grid(B=("hidden_states", 0))``.

    Each value is ``(argument name, tensor dim)``. Axes not given are found at
    the ``Split`` from the full tensor's shape.
    """

    axes: dict[str, tuple[str, int]]

    def __init__(self, **axes: tuple[str, int]) -> None:
        object.__setattr__(self, "axes", dict(axes))


@dataclass(frozen=True)
class Split:
    """Split argument ``arg`` on axis ``shard`` of ``layout``.

    ``arg``: a name, a position, ``"out"`` for every tensor of the output, or a
    path into a nested tuple/list argument, ``("image_rotary_emb", 1)`` (Allegro's
    RoPE is ``((cos, sin) per axis, positions per axis)``: only the positions
    follow the tokens). A tuple or list reached is split at every tensor in it,
    each in ``layout`` (RoPE's ``(cos, sin)``).
    """

    arg: str | int | tuple[str | int, ...]
    layout: str | Layout
    shard: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", _layout(self.layout))
        self.layout.dim_of(self.shard)  # type: ignore[union-attr]
        if isinstance(self.arg, tuple) and (
                not self.arg or not isinstance(self.arg[0], (str, int)) or self.arg[0] == "out"
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.arg[1:])):
            raise ValueError(f"Split(arg={self.arg!r}); expected a path (argument name or position, then element "
                             f"indices into nested tuples), e.g. ('image_rotary_emb', 1)")


@dataclass(frozen=True)
class Gather:
    """Gather argument ``arg`` (a name, a position, or ``"out"``) whose layout is ``layout``.

    The backward depends on who uses the gathered tensor (docs/concepts.md, "Gradients by consumer"):

    - ``partial_grad=False`` (the model's exit): every rank computes the same from it, the model's replicated
      tail. Backward: N times this rank's chunk of the gradient, paired with the 1/N the runtime puts on the
      model's replicated outputs, so a parameter after the gather gets 1/N of its gradient on each rank and
      the sum over the group (``reduce_gradients``) is the one-process gradient. The gather ends the shard:
      later modules see a replicated activation (under ``sharded_io`` the caller's shard comes back instead).
    - ``partial_grad=True`` (a side input of sharded work: a pair bias, a memory every shard attends to):
      each rank uses it for its own shard, so each rank's gradient is partial. Backward: one reduce_scatter,
      the sum over the group, this rank's chunk, no scaling. The activation stays sharded (the forward's
      placement is unchanged), and under ``sharded_io`` the argument is gathered all the same.
    """

    arg: str | int
    layout: str | Layout
    partial_grad: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", _layout(self.layout))
        if not isinstance(self.partial_grad, bool):
            raise TypeError(f"Gather(partial_grad={self.partial_grad!r}); expected a bool (True: the gathered "
                            f"tensor feeds work each rank does on its own shard)")


@dataclass(frozen=True)
class Block:
    """A block whose activation ``arg`` has ``layout``.

    ``attends``: the axis the block mixes (None: it mixes nothing along the
    sequence, or does it through ``Heads``); if it is the sharded one, a switch
    to ``then`` (default: the next sequence axis of the layout) runs first.
    ``out_shard``: the axis the output must be sharded on when it leaves (the
    model's own reshapes after the block need it; a switch runs after the block).
    ``follow``: conditioning arguments ``{name: layout of their leading dims}``,
    e.g. ``{"timestep": "(B T)"}`` (a row per row of the activation) or
    ``{"temb": "B J L K"}`` (a modulation per token): split with the activation
    when it is sharded on an axis of that layout; a tensor with fewer dims than
    the layout, or with length 1 on the sharded axis's dim, is the per-sample
    form the model broadcasts and is left whole.
    ``exact=True``: this block's switches send the activation's own dtype even when
    the plan's ``comm_dtype`` is FP8 (a tensor the model is sensitive to).
    ``local``: integer arguments the model computed from global lengths, given to the
    block as this rank's (``plan.local_args``): ``{"frames": "F"}`` an axis's length
    (SanaVideo unflattens its tokens into ``frames``), or ``fn(value, start, stop,
    total) -> int`` for any other count, ``[start, stop)`` this rank's range of the
    sharded axis of length ``total`` (Helios' new tokens after its history).
    ``refuse``: ``{argument name: why}``, arguments the plan cannot serve: a call that
    passes one (not None) is refused with ``why``, on every rank, before the block's
    hooks move anything (Kandinsky 5's NABLA ``sparse_params``).
    """

    layout: str | Layout
    arg: str | int = 0
    attends: str | None = None
    then: str | None = None
    out_shard: str | None = None
    follow: dict[str, str | Layout] = field(default_factory=dict)
    exact: bool = False
    local: dict[str, str | Callable[[int, int, int, int], int]] = field(default_factory=dict)
    refuse: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", _layout(self.layout))
        for name, why in self.refuse.items():
            if not isinstance(name, str) or not isinstance(why, str) or not why:
                raise ValueError(f"Block(refuse={{{name!r}: {why!r}}}); expected {{argument name: why it is refused}}")
        object.__setattr__(self, "follow", {k: _layout(v) for k, v in self.follow.items()})
        for axis in (self.attends, self.then, self.out_shard):
            if axis is not None:
                self.layout.dim_of(axis)  # type: ignore[union-attr]
        for name, rule in self.local.items():
            if not (callable(rule) or isinstance(rule, str)):
                raise ValueError(f"Block(local={{{name!r}: {rule!r}}}); expected an axis name or a function "
                                 f"(value, start, stop, total) -> int")
            if isinstance(rule, str):
                self.layout.dim_of(rule)  # type: ignore[union-attr]


@dataclass(frozen=True)
class Heads:
    """Full attention inside this module runs on the head shard, whichever kernel it calls.

    The attention, through ``scaled_dot_product_attention`` or any backend of
    diffusers' attention dispatch (``dsp_plugin.plan.attention``), gets q, k, v
    switched from ``L_local`` tokens and all heads to ``L`` tokens and this rank's
    heads (one packed all-to-all), attends locally, and the output switches back
    (one more). The global ``L`` is that of the enclosing ``Block``'s activation.
    A mask built for the global sequence passes through (``plan.masks``).

    ``joint="first"`` / ``"last"``: joint attention, where the module concatenates
    tokens that belong to no position of the sharded sequence and are the same on
    every rank (text in CogVideoX: first; in SD3 / HunyuanVideo: last) with this
    rank's tokens: the attention call holds ``R + L_local`` tokens, and the ``R``
    beyond the local length, at the front or at the back, are the replicated ones.
    They are narrowed to this rank's heads (no communication), attend with the full
    sequence, and their output leaves replicated over heads inside the same
    all-to-all that returns the sharded tokens.

    ``exact=("k",)``: under the plan's ``comm_dtype="fp8"`` these of ``"q"``, ``"k"``,
    ``"v"``, ``"out"`` travel in their own dtype (peers found K the most sensitive).

    ``qkv=("norm_q", "norm_k", "to_v"), out="to_out.0"``: attention the module computes
    itself, per head, without a kernel either level sees (SanaVideo's linear attention):
    the outputs ``[B, L_local, H*C]`` of these three submodules switch to the head shard
    ``[B, L, h*C]`` and the input of ``out`` back (``plan.projections``); the module's
    ``heads`` reads this rank's count during the call.
    """

    joint: str | None = None
    exact: tuple[str, ...] = ()
    qkv: tuple[str, str, str] | None = None
    out: str | None = None

    def __post_init__(self) -> None:
        if (self.qkv is None) != (self.out is None) or (self.qkv is not None and (
                not isinstance(self.qkv, tuple) or len(self.qkv) != 3 or not all(isinstance(q, str) for q in self.qkv)
                or not isinstance(self.out, str) or self.joint is not None)):
            raise ValueError(f"Heads(qkv={self.qkv!r}, out={self.out!r}, joint={self.joint!r}); expected both or "
                             f"neither: qkv the paths of the three submodules whose outputs are q, k, v and out the "
                             f"one whose input is the attention's output, without joint")
        if not isinstance(self.exact, tuple) or any(e not in ("q", "k", "v", "out") for e in self.exact):
            raise ValueError(f"Heads(exact={self.exact!r}); expected a tuple of names among 'q', 'k', 'v', 'out'")
        if self.joint not in (None, "first", "last"):
            raise ValueError(f"Heads(joint={self.joint!r}); expected None, 'first' or 'last' (where the "
                             f"replicated tokens sit in the attention's sequence)")


@dataclass(frozen=True)
class Positions:
    """A module that builds positional tables from the shape of argument ``arg`` (Wan's RoPE).

    Under ``sharded_io`` (the model is fed this rank's shard, e.g. frames, for a
    sampling loop that never gathers), the argument is replaced by a stand-in of
    the global shape that holds no memory (``dims``: tensor dim -> grid axis
    whose global length it takes), so the tables are computed for the global
    grid; a ``Split`` on the module's output then slices them with the shard.
    """

    arg: str | int
    dims: dict[int, str]
