"""``Sharded``: a factorized activation, sharded on one sequence dim, that carries its global lengths.

Real video models do not keep the sequence dims separate between blocks: a
spatial block runs on ``[B*T, S, D]`` and a temporal block on ``[B*S, T, D]``,
and the model reshapes between them with the *global* lengths. To make such a
model DSP-parallel without editing it, an adapter re-expresses the model's
forward around its own blocks with this value type:

    activation  [B, L_1, ..., L_k, D]     sequence dims 1..k, one of them sharded
    fold(d)     -> [B * prod(local L_i, i != d), L_d, D]   what a block attending d runs on
    unfold(y,d) <- the inverse, with the LOCAL lengths of the other dims

``Sharded`` is a thin view over the plan vocabulary (``dsp_plugin.plan``): the
activation is a tensor in layout ``"B L1 .. Lk D"`` (``layout``), its global
lengths a grid (``grid``), and a switch is ``plan.ops.plan_switch`` on them, which
tags the result with the carrier, ``layout.ShardSpec``; entry and exit are the
paper's ``split`` and ``gather`` (whose backward hands every rank the full input
gradient). It stays for adapters written by hand, where hooks cannot reach a
model (a layer reshaping with global lengths from its config; docs/models.md):
such a forward keeps its global lengths in this value, not in a config or a global.
The type is frozen, so the same forward can run in two threads, under activation
checkpointing, or re-entrantly (a pipeline calling the model twice per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dsp_plugin import layout as carrier
from dsp_plugin.comm import chunk_sizes, gather, group_rank, group_size, split
from dsp_plugin.plan import ops
from dsp_plugin.plan.spec import Layout

__all__ = ["Sharded", "check_divisible_lengths"]


def check_divisible_lengths(name: str, lengths: dict[str, int], n: int) -> None:
    """Every sharded sequence dim needs at least one element per rank (raised the same on every rank)."""
    for dim_name, length in lengths.items():
        if length < n:
            raise ValueError(f"{name}: {dim_name}={length} is smaller than the DSP size {n}; every rank "
                             f"needs at least one element of each sharded sequence dim (expected "
                             f"{dim_name} >= {n})")


@dataclass(frozen=True)
class Sharded:
    """``tensor`` is this rank's ``torch.tensor_split`` chunk of tensor dim ``shard``.

    ``tensor`` has shape ``[B, l_1, ..., l_k, D]`` where ``l_i`` is the local
    length of sequence dim ``i`` (the global ``lengths[i-1]`` except on ``shard``).
    """

    tensor: torch.Tensor
    lengths: tuple[int, ...]
    shard: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        # the one carrier: the tensor itself carries its ShardSpec, so a primitive (or a plan hook)
        # handed ``seq.tensor`` reads the global length from it like from any other shard
        ops.tag(self.tensor, self.layout, self.grid, self.axis(self.shard))

    @staticmethod
    def axis(dim: int) -> str:
        """The layout's name of sequence dim ``dim``: ``L1``, ``L2``, ..."""
        return f"L{dim}"

    @property
    def layout(self) -> Layout:
        """``B L1 .. Lk D``: the plan vocabulary's layout of ``tensor``."""
        return Layout.parse("B " + " ".join(self.axis(d) for d in self.sequence_dims) + " D")

    @property
    def grid(self) -> dict[str, int]:
        """Global length of every sequence axis, by layout name."""
        return {self.axis(d): n for d, n in zip(self.sequence_dims, self.lengths)}

    @property
    def spec(self) -> carrier.ShardSpec:
        """The carrier's tag of ``tensor``: ``S(shard)`` of the global length of that dim."""
        return ops.spec_for(self.layout, self.grid, self.axis(self.shard))

    # -- construction -------------------------------------------------------
    @staticmethod
    def enter(x: torch.Tensor, *, shard: int, group: dist.ProcessGroup | None = None) -> Sharded:
        """Replicated ``[B, L_1.., D]`` -> this rank's chunk of dim ``shard`` (``split``, no communication)."""
        lengths = tuple(x.shape[1:-1])
        return Sharded(split(x, shard, group=group), lengths, shard, group)

    @staticmethod
    def wrap(x: torch.Tensor, *, lengths: tuple[int, ...], shard: int,
             group: dist.ProcessGroup | None = None) -> Sharded:
        """An already sharded ``x`` (e.g. tokens embedded from local frames); checks its local lengths."""
        out = Sharded(x, tuple(lengths), shard, group)
        for d in range(1, len(lengths) + 1):
            if x.shape[d] != out.local_len(d):
                raise ValueError(f"Sharded.wrap: dim {d} holds {x.shape[d]}, expected {out.local_len(d)} "
                                 f"(global lengths {lengths}, sharded on dim {shard})")
        return out

    # -- lengths ------------------------------------------------------------
    @property
    def sequence_dims(self) -> tuple[int, ...]:
        return tuple(range(1, len(self.lengths) + 1))

    def global_len(self, dim: int) -> int:
        return self.lengths[dim - 1]

    def local_len(self, dim: int) -> int:
        """Length of sequence dim ``dim`` on this rank."""
        if dim != self.shard:
            return self.lengths[dim - 1]
        return chunk_sizes(self.lengths[dim - 1], group_size(self.group))[group_rank(self.group)]

    def rows_per_sample(self, dim: int) -> int:
        """Rows of ``fold(dim)`` per batch sample: repeat a per-sample condition this many times."""
        return math.prod(self.local_len(d) for d in self.sequence_dims if d != dim)

    # -- data movement ------------------------------------------------------
    def switch(self, tgt: int) -> Sharded:
        """S(shard) -> S(tgt): one all-to-all (none on a size-1 group)."""
        x = ops.plan_switch("Sharded.switch", self.tensor, self.layout, self.grid, self.axis(self.shard),
                            self.axis(tgt), self.group)
        return replace(self, tensor=x, shard=tgt)

    def attend(self, dim: int, *, then: int | None = None) -> Sharded:
        """Ready for a block attending ``dim``: switch away from ``dim`` if it is the sharded one.

        ``then`` picks the target among the other sequence dims (default: the
        next one after ``dim``, cyclically; for two dims simply the other).
        """
        if dim not in self.sequence_dims:
            raise ValueError(f"Sharded.attend: dim {dim} is not a sequence dim {self.sequence_dims}")
        if dim != self.shard:
            return self
        dims = self.sequence_dims
        tgt = then if then is not None else dims[(dims.index(dim) + 1) % len(dims)]
        return self.switch(tgt)

    def leave(self) -> torch.Tensor:
        """S(shard) -> R: one all_gather; the full ``[B, L_1.., D]`` on every rank."""
        return gather(self.tensor, self.shard, group=self.group, global_len=self.global_len(self.shard))

    # -- fold / unfold around a block ----------------------------------------
    def fold(self, dim: int) -> torch.Tensor:
        """``[B, l_1.., l_k, D]`` -> ``[B * prod(l_i, i != dim), L_dim, D]`` (dim must not be sharded)."""
        if dim == self.shard:
            raise ValueError(f"Sharded.fold: dim {dim} is sharded; call attend({dim}) first")
        x = self.tensor.movedim(dim, -2)                 # [B, others.., L_dim, D]
        return x.reshape(-1, x.shape[-2], x.shape[-1])

    def unfold(self, y: torch.Tensor, dim: int) -> Sharded:
        """Inverse of ``fold(dim)`` for a block output ``y`` of the same row count and length."""
        others = [self.local_len(d) for d in self.sequence_dims if d != dim]
        y = y.reshape(self.tensor.shape[0], *others, y.shape[-2], y.shape[-1])  # [B, others.., L_dim, D']
        return replace(self, tensor=y.movedim(-2, dim))

    def map(self, fn: object) -> Sharded:
        """Apply a per-token function (norms, linears, elementwise) to the local tensor."""
        return replace(self, tensor=fn(self.tensor))  # type: ignore[operator]
