"""DSP in Megatron's context-parallel slot gives exactly the documented rank layout.

For every rank of a 16- and an 8-rank world (torch's fake process group, one
process, no communication), ``parallel_state.initialize_model_parallel`` with
``context_parallel_size = dsp`` must produce the TP, DSP, DP, PP and DP x DSP
groups of ``dsp_plugin.topology.rank_layout``, and ``topology_from_parallel_state``
must hand those groups to the primitives.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state as ps  # noqa: E402

from dsp_plugin.megatron.groups import topology_from_parallel_state  # noqa: E402
from dsp_plugin.topology import rank_layout  # noqa: E402


@pytest.mark.parametrize(("world", "tp", "dsp", "pp"), [(16, 2, 2, 2), (8, 2, 4, 1), (8, 1, 2, 2)])
def test_megatron_groups_follow_the_dsp_layout(world: int, tp: int, dsp: int, pp: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    layout = rank_layout(world, tp=tp, dsp=dsp, pp=pp)
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            ps.initialize_model_parallel(tp, pp, context_parallel_size=dsp, order="tp-cp-ep-dp-pp",
                                         create_gloo_process_groups=False)
            megatron = {
                "tp": ps.get_tensor_model_parallel_group(),
                "dsp": ps.get_context_parallel_group(),
                "dp": ps.get_data_parallel_group(),
                "pp": ps.get_pipeline_model_parallel_group(),
                "dp_dsp": ps.get_data_parallel_group(with_context_parallel=True),
            }
            for axis, group in megatron.items():
                expected = next(ranks for ranks in layout[axis] if rank in ranks)
                assert sorted(dist.get_process_group_ranks(group)) == expected, (rank, axis)
            topology = topology_from_parallel_state()
            assert (topology.tp, topology.dsp, topology.dp, topology.pp) == (tp, dsp, world // (tp * dsp * pp), pp)
            assert topology.dsp_group is megatron["dsp"] and topology.dp_dsp_group is megatron["dp_dsp"]
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
