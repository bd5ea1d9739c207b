"""Which group a call means, and this rank's place in it: ``group=None`` and the no-topology rule.

``group=None`` is the DSP group of the installed topology (``dsp_plugin.topology``); a
one-dimensional ``DeviceMesh`` (``mesh["dsp"]``, a sub-mesh or a flattened dim) is its process group
(``as_process_group``), wherever a ``group=`` is taken;
without torch.distributed, or on a world of one rank, a call runs on a group of
size 1. On more than one rank with no topology it refuses (``NoTopologyError``)
rather than shard over a world that the framework reduces its own way; started as
one of several processes (``WORLD_SIZE`` > 1) with no process group it refuses too
(``NoProcessGroupError``) rather than run the whole model on every rank.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NoProcessGroupError", "NoTopologyError", "as_process_group", "check_launched_alone", "group_rank",
           "group_size", "no_topology_message"]


class NoTopologyError(RuntimeError):
    """``group=None`` on more than one rank with no topology installed; raised alike on every rank."""


def no_topology_message(name: str) -> str:
    """What ``group=None`` without a topology says (also the text ``reduce_gradients`` raises)."""
    return (f"{name}: group=None means the DSP group of the installed topology, but none is installed and the "
            f"world has {dist.get_world_size()} ranks; refusing to shard over the whole world (a framework that "
            f"reduces gradients its own way would train silently wrong). Fix: after init_process_group call "
            f"dsp_plugin.set_topology(dsp_plugin.Topology.build(dsp=N)) (Topology.world() for one DSP group of "
            f"every rank), or pass group= explicitly. Under DeepSpeed: the config needs "
            f"\"sequence_parallel_mode\": \"dsp\" with \"sequence_parallel_size\": N, and the engine must come "
            f"from dsp_plugin.deepspeed.initialize (it installs the topology).")


class NoProcessGroupError(NoTopologyError):
    """Started as one of several processes (torchrun's ``WORLD_SIZE``) with no process group: raised alike on
    every rank."""


def check_launched_alone(name: str) -> None:
    """Refuse to run unparallel on each of several launched processes.

    torchrun (and the DeepSpeed launcher, Slurm's srun through torchrun) export ``WORLD_SIZE``; a
    script that never calls ``init_process_group`` would otherwise have every rank compute the whole
    sequence alone, N times the work with nothing shared, and exit 0.
    """
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise NoProcessGroupError(
            f"{name}: this process is rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} (a launcher such as "
            f"torchrun started {world} processes), but torch.distributed is not initialised, so every rank would "
            f"run the whole model alone. Fix: call torch.distributed.init_process_group() first (backend "
            f"\"nccl\" on GPUs, \"gloo\" on CPU; dsp_plugin.backend.choose() picks one), then install a topology "
            f"(dsp_plugin.set_topology(dsp_plugin.Topology.build(dsp=N)), or sampling_groups() for sampling).")


def as_process_group(group: Any, name: str) -> Any:
    """``group`` as the process group a call runs on: a ``ProcessGroup`` or None as given; a ``DeviceMesh`` of one
    dimension (``mesh["dsp"]``, a sub-mesh, ``mesh["dp_shard", "dsp"]._flatten()``) its group; a mesh of more
    dimensions refused, naming them (which of its dims DSP runs over is the caller's to say)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group, DeviceMesh):
        return group  # torch's NON_GROUP_MEMBER (an int) and the like: as before
    if group.ndim != 1:
        names = group.mesh_dim_names
        dsp = "dsp" if names and "dsp" in names else "<the DSP dim>"
        raise ValueError(f"{name}: group= is a {group.ndim}-D DeviceMesh (dims {names}, shape {tuple(group.shape)});"
                         f" expected a process group or a 1-D DeviceMesh, the dimension DSP shards over: "
                         f"group=mesh[{dsp!r}]")
    if group.get_coordinate() is None:
        raise ValueError(f"{name}: group= is a DeviceMesh over ranks {group.mesh.flatten().tolist()}, which do not "
                         f"include this process (global rank {dist.get_rank()}); expected the mesh's own dim on "
                         f"every rank (mesh[\"dsp\"], which each rank slices to its DSP group)")
    return group.get_group()


def _resolve_group(group: Any, name: str = "dsp_plugin") -> dist.ProcessGroup | None:
    """``None`` -> the DSP group of the installed topology; an error on > 1 rank without one. A 1-D ``DeviceMesh``
    -> its process group (``as_process_group``).

    Returns None when torch.distributed is not initialised: a single process is
    a DSP group of size 1 (so is a world of one rank).
    """
    if group is not None:
        return group if isinstance(group, dist.ProcessGroup) else as_process_group(group, name)
    if not (dist.is_available() and dist.is_initialized()):
        check_launched_alone(name)
        return None
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    if topology is not None:
        return topology.dsp_group
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    raise NoTopologyError(no_topology_message(name))


# a group's (size, this process's rank in it: -1 if not a member), asked of torch once per group: they are fixed
# for the group's life, and torch's get_rank costs 5-25 us a call (on WORLD the most), on every hook and collective
_PLACES: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, int]] = weakref.WeakKeyDictionary()


def _place(group: dist.ProcessGroup) -> tuple[int, int]:
    """(size, rank) of ``group``, torch's ``get_world_size`` / ``get_rank``; traced as torch's under torch.compile
    (dynamo folds those two into constants)."""
    if torch.compiler.is_compiling():
        return dist.get_world_size(group), dist.get_rank(group)
    try:
        place = _PLACES.get(group)
    except TypeError:  # not weak-referenceable: torch's NON_GROUP_MEMBER (an int) on a rank outside the group
        return _asked(group)
    if place is None:
        place = _PLACES[group] = _asked(group)
    return place


def _asked(group: dist.ProcessGroup) -> tuple[int, int]:
    rank = dist.get_rank(group)
    return (dist.get_world_size(group) if rank >= 0 else -1), rank


def _group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int]:
    group = _resolve_group(group, "group_size")
    return group, (1 if group is None else _place(group)[0])


def _member(name: str, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, size, rank in group); a clear error at once for a group this process is not in."""
    group = _resolve_group(group, name)
    if group is None:
        return None, 1, 0
    size, rank = _place(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"it was given (ranks {dist.get_process_group_ranks(group)}); expected a group that "
                         f"contains this rank, or group=None for the DSP group")
    return group, size, rank


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (resolved as in the primitives); 1 without torch.distributed."""
    return _group_and_size(group)[1]


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group``; 0 without torch.distributed."""
    group = _resolve_group(group, "group_rank")
    return 0 if group is None else _place(group)[1]
