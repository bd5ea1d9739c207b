"""Process groups for TP x DSP x DP x PP, in Megatron's rank order.

Megatron orders ranks ``tp-cp-ep-dp-pp`` (innermost first). DSP takes the
context-parallel slot, so TP ranks are adjacent, then DSP, then DP, then PP:

    rank = tp_rank + tp * (dsp_rank + dsp * (dp_rank + dp * pp_rank))

Keeping DSP next to TP keeps a DSP group inside a node, where its all-to-alls
ride NVLink. Parameters are replicated across a DSP group, so gradients are
reduced over the DP x DSP group (``dp_dsp_group``); ZeRO partitions over DP.

``rank_layout`` is the pure arithmetic (no processes needed, used by the docs and
tests); ``Topology.build`` creates the groups (``Topology.from_mesh`` reads them off a
torch ``DeviceMesh``, ``dsp_plugin.mesh``); ``set_topology`` makes one the
default that ``group=None`` in the primitives refers to. Without one installed,
``group=None`` on more than one rank is an error (``comm``): sharding over a
world that the training framework reduces its own way is a silent wrong result.

Groups inherit the world's collective timeout (the one given to
``init_process_group``) unless ``Topology.build`` is given another, so a dead or
frozen peer is reported within the user's timeout, not torch's 30-minute default.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AXES", "Topology", "get_topology", "rank_layout", "set_topology", "validate_sizes", "world_timeout"]

#: Mesh axes from innermost (adjacent ranks) to outermost.
AXES = ("tp", "dsp", "dp", "pp")


def validate_sizes(world_size: int, *, tp: int = 1, dsp: int = 1, pp: int = 1) -> int:
    """Check that ``world_size`` factors as tp * dsp * dp * pp and return dp.

    Raises ValueError naming every factor, e.g.
    ``world size 6 is not divisible by tp(2) * dsp(4) * pp(1) = 8``.
    """
    for name, value in (("world size", world_size), ("tp", tp), ("dsp", dsp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"invalid parallel sizes: {name} must be a positive int, got {value!r} "
                             f"(world size {world_size!r}, tp({tp!r}), dsp({dsp!r}), pp({pp!r}))")
    model = tp * dsp * pp
    if world_size % model:
        raise ValueError(f"invalid parallel sizes: world size {world_size} is not divisible by "
                         f"tp({tp}) * dsp({dsp}) * pp({pp}) = {model}")
    return world_size // model


def rank_layout(world_size: int, *, tp: int = 1, dsp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """The rank lists of every group, per axis, in Megatron order.

    Keys: ``tp``, ``dsp``, ``dp``, ``pp``, ``dp_dsp`` (gradient reduction) and
    ``model_parallel`` (tp x pp, what DeepSpeed calls the model-parallel group).

    >>> rank_layout(8, tp=2, dsp=2)["dsp"]
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    dp = validate_sizes(world_size, tp=tp, dsp=dsp, pp=pp)
    sizes = {"tp": tp, "dsp": dsp, "dp": dp, "pp": pp}

    def rank_of(c: dict[str, int]) -> int:
        return c["tp"] + tp * (c["dsp"] + dsp * (c["dp"] + dp * c["pp"]))

    def groups(varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [a for a in AXES if a not in varying]
        out = []
        for outer in _product([sizes[a] for a in fixed]):
            ranks = []
            for inner in _product([sizes[a] for a in varying]):
                coords = dict(zip(fixed, outer)) | dict(zip(varying, inner))
                ranks.append(rank_of(coords))
            out.append(sorted(ranks))
        return sorted(out)

    return {
        "tp": groups(("tp",)),
        "dsp": groups(("dsp",)),
        "dp": groups(("dp",)),
        "pp": groups(("pp",)),
        "dp_dsp": groups(("dsp", "dp")),
        "model_parallel": groups(("tp", "pp")),
    }


def world_timeout() -> datetime.timedelta | None:
    """The collective timeout of the default process group (what ``init_process_group`` was given).

    None when it cannot be read (torch.distributed not initialised, or a backend
    that does not expose its options); ``new_group`` then applies torch's default.
    """
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    combos: list[tuple[int, ...]] = [()]
    for size in sizes:
        combos = [c + (i,) for c in combos for i in range(size)]
    return combos


@dataclass
class Topology:
    """Sizes, this rank's coordinates and its groups on every axis.

    Build it with ``Topology.build`` or construct it from groups that already
    exist (Megatron's ``parallel_state``). ``None`` groups stand for size 1.
    """

    tp: int
    dsp: int
    dp: int
    pp: int
    rank: int
    world_size: int
    tp_group: dist.ProcessGroup | None = None
    dsp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_dsp_group: dist.ProcessGroup | None = None
    model_parallel_group: dist.ProcessGroup | None = None
    layout: dict[str, list[list[int]]] = field(default_factory=dict, repr=False)
    mesh: Any = field(default=None, repr=False)  # the DeviceMesh of ``from_mesh`` (dsp_plugin.fsdp shards over it)

    @classmethod
    def build(cls, *, tp: int = 1, dsp: int | None = None, pp: int = 1,
              timeout: datetime.timedelta | None = None) -> Topology:
        """Create every group from the initialised world; ``dsp=None`` takes all that TP and PP leave.

        Sizes are validated before any group is created, so a bad
        factorisation raises on every rank and no rank waits on the others.
        ``timeout=None`` gives every group the world's timeout (``world_timeout``).
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build: torch.distributed is not initialised; "
                               "call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        if dsp is None:
            validate_sizes(world, tp=tp, pp=pp)
            dsp = world // (tp * pp)
        dp = validate_sizes(world, tp=tp, dsp=dsp, pp=pp)
        layout = rank_layout(world, tp=tp, dsp=dsp, pp=pp)
        rank = dist.get_rank()
        if timeout is None:
            timeout = world_timeout()
        mine: dict[str, dist.ProcessGroup | None] = {}
        # Every rank creates every group, in the same order (new_group requires it).
        for axis, rank_lists in layout.items():
            for ranks in rank_lists:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[axis] = group
        return cls(tp=tp, dsp=dsp, dp=dp, pp=pp, rank=rank, world_size=world,
                   tp_group=mine["tp"], dsp_group=mine["dsp"], dp_group=mine["dp"], pp_group=mine["pp"],
                   dp_dsp_group=mine["dp_dsp"], model_parallel_group=mine["model_parallel"], layout=layout)

    @classmethod
    def world(cls) -> Topology:
        """The whole world as one DSP group (tp = dp = pp = 1), on the default group: no collective, no new group.

        What ``set_topology(Topology.world())`` after ``init_process_group`` says
        explicitly: the paper's four lines then shard over every rank.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.world: torch.distributed is not initialised; "
                               "call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        return cls(tp=1, dsp=world, dp=1, pp=1, rank=dist.get_rank(), world_size=world,
                   dsp_group=dist.group.WORLD, dp_dsp_group=dist.group.WORLD,
                   layout=rank_layout(world, dsp=world))

    @classmethod
    def from_mesh(cls, mesh: Any) -> Topology:
        """The topology of a torch ``DeviceMesh`` whose dims are named among ``pp``, ``dp_replicate``, ``dp_shard``
        (or ``dp``), ``dsp``, ``tp`` in that order (outermost first; ``dsp`` required): its groups are the mesh's own
        (several dims flattened, ``dsp_plugin.mesh``), no group is created beyond those. DP is ``dp_replicate x
        dp_shard``; the gradient group ``dp_dsp_group`` is DP x DSP. Names, order and layout are checked before any
        group is made, with an error naming the mesh's dims and what was expected.
        """
        from dsp_plugin.mesh import DP_DIMS, flat_group, mesh_sizes

        sizes = mesh_sizes(mesh, "Topology.from_mesh")
        tp, dsp, pp = sizes.get("tp", 1), sizes["dsp"], sizes.get("pp", 1)
        world = dist.get_world_size()
        dp = validate_sizes(world, tp=tp, dsp=dsp, pp=pp)
        dp_dims = [d for d in DP_DIMS if d in sizes]
        return cls(tp=tp, dsp=dsp, dp=dp, pp=pp, rank=dist.get_rank(), world_size=world,
                   tp_group=flat_group(mesh, [d for d in ("tp",) if d in sizes]),
                   dsp_group=flat_group(mesh, ["dsp"]), dp_group=flat_group(mesh, dp_dims),
                   pp_group=flat_group(mesh, [d for d in ("pp",) if d in sizes]),
                   dp_dsp_group=flat_group(mesh, [*dp_dims, "dsp"]),
                   model_parallel_group=flat_group(mesh, [d for d in ("pp", "tp") if d in sizes]),
                   layout=rank_layout(world, tp=tp, dsp=dsp, pp=pp), mesh=mesh)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank) on each axis."""
        r = self.rank if rank is None else rank
        out = {}
        for axis, size in zip(AXES, (self.tp, self.dsp, self.dp, self.pp)):
            out[axis] = r % size
            r //= size
        return out

    def describe(self) -> str:
        """One line for logs: ``tp(1) x dsp(4) x dp(1) x pp(1) = 4; rank 2 at tp=0 dsp=2 dp=0 pp=0``."""
        coords = " ".join(f"{a}={v}" for a, v in self.coords().items())
        return (f"tp({self.tp}) x dsp({self.dsp}) x dp({self.dp}) x pp({self.pp}) = {self.world_size}; "
                f"rank {self.rank} at {coords}")


_CURRENT: Topology | None = None


def set_topology(topology: Topology | None) -> None:
    """Make ``topology`` the one ``group=None`` refers to (None: uninstall; ``group=None`` then refuses on > 1 rank)."""
    global _CURRENT
    _CURRENT = topology


def get_topology() -> Topology | None:
    """The topology installed by ``set_topology``, or None."""
    return _CURRENT
