"""A torch ``DeviceMesh`` read as the topology: its dim names, their order, the groups DSP needs.

torchtitan and FSDP2 users build one mesh for the whole job (``init_device_mesh``) and slice it by name.
``Topology.from_mesh(mesh)`` maps such a mesh onto ``dsp_plugin.topology``'s axes, so ``group=None``, the
data loader's DP coordinate and the DP x DSP gradient group come from the same mesh FSDP shards over.

Dim names (outermost first, the order ``init_device_mesh`` lays ranks out in, row-major)::

    pp, dp_replicate, dp_shard | dp, dsp, tp

This is Megatron's ``tp-cp-dp-pp`` rank order with DSP in the context-parallel slot, and torchtitan's
``pp, dp_replicate, dp_shard, cp, tp``: TP innermost, then DSP, so a DSP group stays inside a node. ``dsp`` is
required; the others are optional (absent: size 1). ``dp_replicate`` x ``dp_shard`` (HSDP) together are the
topology's DP axis; ``dp`` names a DP axis with no such split. A mesh in another order, or over ranks other than
``0 .. world-1`` in row-major order, is refused: the topology's rank arithmetic (``rank_layout``) would disagree
with the mesh's groups.

Groups of several dims are the mesh's own flattened dims (``DeviceMesh._flatten``, as torchtitan builds its
``dp_shard_cp``), named by joining the dim names with ``_`` (``dp_shard_dsp``), so a second caller that
flattens the same dims gets the same group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DP_DIMS", "MESH_DIMS", "flat_group", "flat_mesh", "mesh_sizes"]

#: the dim names a mesh may have, outermost first (``dp`` and ``dp_shard`` share a slot: one or the other)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "dp", "dsp", "tp")
#: the dims that make up the topology's data-parallel axis, outermost first
DP_DIMS = ("dp_replicate", "dp_shard", "dp")

_HINT = ("expected e.g. init_device_mesh(device, (2, 2), mesh_dim_names=(\"dp_shard\", \"dsp\")), dims named among "
         "pp, dp_replicate, dp_shard (or dp), dsp, tp in that order (outermost first: Megatron's rank order with DSP "
         "in the context-parallel slot)")


def mesh_sizes(mesh: Any, name: str) -> dict[str, int]:
    """``{dim name: size}`` of ``mesh`` in its order, after checking the names, their order and that the mesh is the
    whole world laid out row-major; a ``ValueError`` (``TypeError`` for a non-mesh) naming what is wrong."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{name}: expected a torch.distributed DeviceMesh (init_device_mesh), got "
                        f"{type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"{name}: the mesh of shape {tuple(mesh.shape)} has no dim names; {_HINT}")
    sizes = dict(zip(names, mesh.shape))
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        cp = " (DSP takes the context-parallel slot: name that dim 'dsp')" if "cp" in unknown else ""
        raise ValueError(f"{name}: mesh dim(s) {unknown} of {_describe(sizes)} are not among {', '.join(MESH_DIMS)}"
                         f"{cp}; {_HINT}")
    if "dsp" not in sizes:
        raise ValueError(f"{name}: the mesh {_describe(sizes)} has no 'dsp' dim (add one, of size 1 for no DSP); "
                         f"{_HINT}")
    if "dp" in sizes and ("dp_shard" in sizes or "dp_replicate" in sizes):
        raise ValueError(f"{name}: the mesh {_describe(sizes)} names both 'dp' and dp_replicate/dp_shard; expected "
                         f"'dp' alone or dp_replicate and/or dp_shard (HSDP)")
    order = [MESH_DIMS.index(n) for n in names]
    if order != sorted(order):
        expected = tuple(n for n in MESH_DIMS if n in sizes)
        raise ValueError(f"{name}: the mesh's dims {names} are not in the topology's order; expected "
                         f"mesh_dim_names={expected} (outermost first: TP innermost, then DSP, so a DSP group stays "
                         f"inside a node)")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"{name}: the mesh {_describe(sizes)} spans {mesh.size()} ranks, the world has {world}; "
                         f"expected the whole world (the mesh init_device_mesh returns, not a sub-mesh)")
    if not torch.equal(mesh.mesh.flatten().cpu(), torch.arange(world)):
        raise ValueError(f"{name}: the mesh {_describe(sizes)} holds ranks {mesh.mesh.flatten().tolist()}; expected "
                         f"0..{world - 1} in row-major order (init_device_mesh's layout), which the topology's rank "
                         f"order assumes")
    return sizes


def flat_mesh(mesh: Any, dims: list[str] | tuple[str, ...]) -> Any:
    """The 1-D mesh over ``dims`` of ``mesh`` (one dim: its slice; several: their flattened dim, ``a_b``)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    return mesh[tuple(dims)]._flatten()


def flat_group(mesh: Any, dims: list[str] | tuple[str, ...]) -> dist.ProcessGroup | None:
    """The process group of ``flat_mesh(mesh, dims)``; None for no dims (size 1)."""
    return flat_mesh(mesh, dims).get_group() if dims else None


def _describe(sizes: dict[str, int]) -> str:
    return " x ".join(f"{n}({s})" for n, s in sizes.items())
