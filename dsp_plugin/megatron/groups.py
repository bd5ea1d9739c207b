"""The DSP group lives in megatron.core.parallel_state's context-parallel slot.

Megatron builds its groups in the order ``tp-cp-ep-dp-pp``. Giving it
``context_parallel_size = dsp`` makes the CP groups exactly the DSP groups of
``dsp_plugin.topology.rank_layout`` (TP innermost, then DSP), and then, for free:

- Megatron DDP and the distributed optimizer reduce gradients over
  ``get_data_parallel_group(with_context_parallel=True)`` = DP x DSP;
- samplers use ``get_data_parallel_rank()`` (without CP), so the ranks of a DSP
  group read the same samples;
- checkpoint replica ids treat DSP ranks as replicas of the same shard.

Only the *model's* ``TransformerConfig`` keeps ``context_parallel_size = 1``, so
attention runs locally (see ``layers.py``). ``topology_from_parallel_state``
hands Megatron's groups to the DSP primitives as a ``Topology``.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from dsp_plugin.topology import Topology, rank_layout, set_topology, validate_sizes

__all__ = ["dsp_group", "initialize_dsp_model_parallel", "install_topology", "topology_from_parallel_state"]


def initialize_dsp_model_parallel(*, tp: int = 1, dsp: int = 1, pp: int = 1, timeout_minutes: int = 10,
                                  create_gloo_process_groups: bool = True) -> Topology:
    """What Megatron's ``_initialize_distributed`` does, with DSP in the CP slot; installs the topology.

    Validates the sizes first (ValueError naming every factor, before any
    collective), then calls ``parallel_state.initialize_model_parallel``.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_dsp_model_parallel: torch.distributed is not initialised")
    validate_sizes(dist.get_world_size(), tp=tp, dsp=dsp, pp=pp)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=dsp,
        distributed_timeout_minutes=timeout_minutes,
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=create_gloo_process_groups,  # Megatron's optimizer wants them
    )
    return install_topology()


def dsp_group() -> dist.ProcessGroup:
    """The DSP group of this rank: Megatron's context-parallel group."""
    return ps.get_context_parallel_group()


def topology_from_parallel_state() -> Topology:
    """A ``Topology`` over Megatron's existing groups (no new group is created).

    Checks that Megatron's CP ranks are the DSP ranks of ``rank_layout``, so the
    rank order in the docs is the one that runs.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    dsp = ps.get_context_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    layout = rank_layout(world, tp=tp, dsp=dsp, pp=pp)
    mine = next(ranks for ranks in layout["dsp"] if rank in ranks)
    megatron_dsp = sorted(ps.get_context_parallel_global_ranks())
    if megatron_dsp != mine:
        raise RuntimeError(f"topology_from_parallel_state: Megatron's context-parallel ranks {megatron_dsp} "
                           f"differ from the DSP layout {mine}; was parallel_state initialised with "
                           "order 'tp-cp-ep-dp-pp'?")
    return Topology(
        tp=tp, dsp=dsp, dp=dp, pp=pp, rank=rank, world_size=world,
        tp_group=ps.get_tensor_model_parallel_group(),
        dsp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_dsp_group=ps.get_data_parallel_group(with_context_parallel=True),
        model_parallel_group=ps.get_model_parallel_group(),
        layout=layout,
    )


def install_topology() -> Topology:
    """Build the topology from parallel_state and make it the default of ``group=None``."""
    topology = topology_from_parallel_state()
    set_topology(topology)
    return topology
