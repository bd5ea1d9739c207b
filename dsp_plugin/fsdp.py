"""FSDP2 over DP x DSP: torch's ``fully_shard`` on a parallelized model, with the one-process gradient.

    mesh = init_device_mesh("cuda", (dp, dsp), mesh_dim_names=("dp_shard", "dsp"))
    dsp_plugin.set_topology(dsp_plugin.Topology.from_mesh(mesh))
    model = dsp_plugin.parallelize(model, group=mesh["dsp"])         # the plan first
    model = dsp_plugin.fsdp.fully_shard(model, mesh, mp_policy=...)  # then FSDP2, per block and on the root

Parameters are replicated across a DSP group, so FSDP2 shards them over DP x DSP: ``fully_shard`` runs on the
flattened ``dp_shard x dsp`` mesh (``dp_shard_dsp``, as torchtitan shards over ``dp_shard_cp``), or, for HSDP,
on the 2-D ``(dp_replicate, dp_shard_dsp)`` mesh (replicate x shard).

**What it sets.** FSDP2's default reduction averages over its mesh: the sum of every rank's gradient divided by
``dp x dsp``. Under the plan's convention (docs/concepts.md) a rank's gradient is the partial sum over its
tokens, so the one-process gradient of the global batch is the sum over the DSP group and the *mean* over DP:
the sum over every rank divided by ``dp`` only. ``fully_shard`` therefore calls
``set_gradient_divide_factor(dp)`` on every FSDP module it makes (``dp = dp_replicate x dp_shard``; FSDP2 turns
it into NCCL's ``PREMUL_SUM(1/dp)`` on the reduce-scatter, or ``AVG`` when ``dp`` equals the reduce-scatter's
size, and a ``SUM`` all-reduce across replicas). That is what multiplying the loss by ``dsp`` does with FSDP's
default, without touching the loss. On a CPU mesh (gloo, which has no ``PREMUL_SUM``) it also sets
``set_force_sum_reduction_for_comms(True)``: a ``SUM`` reduce-scatter, then a division by ``dp``.

It also sets ``set_reduce_scatter_unused_params(True)``: a parameter some rank did not use this step (a token
only one rank's shard holds) is reduce-scattered with zeros there, so every rank issues the same collective.
That is FSDP's own form of what ``parallelize`` installs for DDP and ZeRO (``dsp_plugin.every_gradient``), which
is removed here: its forward hooks would hold the unsharded parameters ``fully_shard`` replaced, a full copy
of the model on every rank. (A parameter *no* rank used gets a zero gradient rather than none.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from dsp_plugin import every_gradient
from dsp_plugin.comm.group_resolution import _resolve_group
from dsp_plugin.mesh import DP_DIMS, flat_mesh, mesh_sizes

__all__ = ["data_parallel_mesh", "fully_shard", "gradient_divide_factor", "planned_blocks"]

_NAME = "dsp_plugin.fsdp.fully_shard"


def gradient_divide_factor(mesh: Any) -> int:
    """The divide factor that makes FSDP2's reduction the one-process gradient: the DP size (``dp_replicate x
    dp_shard``, or ``dp``) of ``mesh``, not the ``dp x dsp`` FSDP2 divides by when none is set."""
    sizes = mesh_sizes(mesh, "gradient_divide_factor")
    factor = 1
    for dim in DP_DIMS:
        factor *= sizes.get(dim, 1)
    return factor


def data_parallel_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard x dsp`` flattened (1-D), or ``(dp_replicate, dp_shard_dsp)`` (2-D,
    HSDP) when ``mesh`` has a ``dp_replicate`` dim of size > 1. ``dp`` counts as ``dp_shard``."""
    sizes = mesh_sizes(mesh, _NAME)
    shard = [d for d in ("dp_shard", "dp", "dsp") if d in sizes]
    flat = flat_mesh(mesh, shard)
    if sizes.get("dp_replicate", 1) == 1:
        return flat
    # the replicate dim beside the flattened one, on their existing groups (slicing a flattened dim from the root,
    # mesh["dp_replicate", "dp_shard_dsp"], is deprecated since torch 2.11)
    return type(mesh)._concatenate([mesh["dp_replicate"], flat])


def planned_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules the plan names as ``Block`` (outermost ones: a block inside another is not listed), in the
    model's order: the units FSDP2 all-gathers and reduce-scatters one at a time."""
    from dsp_plugin.plan.spec import Block

    runtime = getattr(model, "_dsp_plan_runtime", None)
    if runtime is None:
        raise ValueError(f"{_NAME}: {type(model).__name__} is not parallelized; expected the plan first, then "
                         f"fully_shard: model = dsp_plugin.parallelize(model, group=mesh['dsp']) (docs/fsdp.md, "
                         f"'the order of wrapping')")
    paths = [path for path, _, specs in runtime.entries if any(isinstance(s, Block) for s in specs)]
    outer = [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]
    modules = dict(model.named_modules())
    return [modules[p] for p in outer if p]


def fully_shard(model: nn.Module, mesh: Any = None, *, blocks: Iterable[nn.Module] | None = None,
                **fsdp_kwargs: Any) -> nn.Module:
    """Apply torch's ``fully_shard`` to each block of the parallelized ``model`` and to the root, over the DP x DSP
    mesh (``data_parallel_mesh``), with the divide factor that gives the one-process gradient (module docstring).

    ``mesh``: the job's ``DeviceMesh`` (dims among ``dp_replicate``, ``dp_shard`` or ``dp``, ``dsp``; None: the
    mesh of the installed topology, ``Topology.from_mesh``). ``blocks``: the modules to shard one by one (default:
    the plan's ``Block`` modules, ``planned_blocks``). ``fsdp_kwargs`` go to torch's ``fully_shard``
    (``mp_policy``, ``reshard_after_forward``, ``offload_policy``). Every check runs before any group is made.
    Returns ``model``, an ``FSDPModule``.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if mesh is None:
        from dsp_plugin.topology import get_topology

        topology = get_topology()
        mesh = getattr(topology, "mesh", None)
        if mesh is None:
            raise ValueError(f"{_NAME}: mesh=None means the mesh of the installed topology, but none is installed "
                             f"from a mesh; expected fully_shard(model, mesh) or "
                             f"dsp_plugin.set_topology(dsp_plugin.Topology.from_mesh(mesh)) first")
    if "mesh" in fsdp_kwargs:
        raise TypeError(f"{_NAME}: mesh is the second argument (the job's mesh with a 'dsp' dim), not a keyword for "
                        f"torch's fully_shard; the mesh FSDP2 shards over is derived from it")
    sizes = mesh_sizes(mesh, _NAME)
    for dim in ("tp", "pp"):
        if sizes.get(dim, 1) > 1:
            raise ValueError(f"{_NAME}: the mesh has {dim}({sizes[dim]}); this helper shards models whose "
                             f"parameters are plain tensors over the data-parallel and DSP dims only; expected "
                             f"{dim} of size 1 (with tensor or pipeline parallelism call torch's fully_shard on "
                             f"your stage yourself and set_gradient_divide_factor(dp), docs/fsdp.md)")
    planned = planned_blocks(model)  # refuses a model not parallelized yet
    units = planned if blocks is None else list(blocks)
    _check_plan_group(model, mesh)
    fsdp_mesh = data_parallel_mesh(mesh)
    factor = float(gradient_divide_factor(mesh))
    for block in units:
        torch_fully_shard(block, mesh=fsdp_mesh, **fsdp_kwargs)
    torch_fully_shard(model, mesh=fsdp_mesh, **fsdp_kwargs)
    every_gradient.remove(model)  # FSDP's reduce_scatter_unused_params below does its work (module docstring)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            module.set_reduce_scatter_unused_params(True, recurse=False)
            if fsdp_mesh.device_type == "cpu":  # gloo: no PREMUL_SUM; a SUM reduce-scatter, then / dp
                module.set_force_sum_reduction_for_comms(True)
    return model


def _check_plan_group(model: nn.Module, mesh: Any) -> None:
    """The plan shards over the mesh's ``dsp`` dim: else the divide factor (and the sharding) would be wrong."""
    runtime = model._dsp_plan_runtime
    group = _resolve_group(runtime.group, _NAME)
    planned = [0] if group is None else dist.get_process_group_ranks(group)
    dsp = dist.get_process_group_ranks(mesh["dsp"].get_group())
    if planned != dsp:
        raise ValueError(f"{_NAME}: the plan shards over ranks {planned}, the mesh's 'dsp' dim holds ranks {dsp} on "
                         f"this rank; expected the same group: parallelize(model, group=mesh['dsp']), or "
                         f"set_topology(Topology.from_mesh(mesh)) and group=None")
