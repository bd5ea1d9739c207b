"""CommAccounting sees collectives at the dispatcher: C++ callers (DDP's reducer), functional
collectives and point-to-point ops, each record naming its group by global ranks.

The byte counts are checked against numbers computed here from the tensors' sizes and the
table in ``dsp_plugin.accounting`` (ring all-reduce moves ``2 * bytes * (N - 1) / N``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from dsp_plugin import Topology, dynamic_switch, set_topology
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.collective_bytes import OPS
from tests.distributed import run_distributed


def _ddp_and_groups(rank: int, n: int) -> dict[str, object]:
    topo = Topology.build(dsp=2)                    # 4 ranks: DSP groups (0, 1), (2, 3); DP (0, 2), (1, 3)
    set_topology(topo)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 3), process_group=topo.dp_group)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(2, 5, 6, 4)                     # a [B, T, S, D] shard on T
    dynamic_switch(x, 1, 2, global_len=10)          # a first call may agree on the signature (checks)
    with CommAccounting(activations=False) as acct:
        model(torch.randn(2, 4)).sum().backward()   # DDP all-reduces the gradient bucket from C++
        with CommAccounting(activations=False) as inner:   # blocks nest: both record the switch
            dynamic_switch(x, 1, 2, global_len=10)  # S(T) -> S(S) on the DSP group
        y = funcol.wait_tensor(funcol.all_reduce(torch.ones(6), "sum", topo.dsp_group))
        peer = rank ^ 1                             # the other rank of this DSP group
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), peer),
                                        dist.P2POp(dist.irecv, torch.empty(3), peer)])
        for work in works:
            work.wait()
        world_gathered, world_part = torch.empty(4 * 6), torch.empty(6)   # N = 4: (N - 1) is no longer 1
        dist.all_gather_into_tensor(world_gathered, torch.ones(6))
        dist.reduce_scatter_tensor(world_part, torch.ones(4 * 6))
    with CommAccounting(activations=False) as checked:   # a new signature: the ranks agree on it first
        dynamic_switch(torch.randn(2, 3, 6, 4), 1, 2, global_len=6)
    set_topology(None)
    records = [(r.op, r.phase, getattr(r, "group_ranks", None), r.bytes_sent, r.bytes_received)
               for r in acct.records]
    return {"records": records, "param_bytes": param_bytes, "y": y.tolist(),
            "dp": tuple(dist.get_process_group_ranks(topo.dp_group)),
            "dsp": tuple(dist.get_process_group_ranks(topo.dsp_group)),
            "dp_selected": acct.count("all_reduce", group=topo.dp_group),
            "by_group": acct.by_group(), "inner": [r.op for r in inner.records],
            "checked": [(r.op, r.phase) for r in checked.check_records + checked.records]}


def test_ddp_functional_and_p2p_collectives_are_counted_with_their_group_ranks() -> None:
    results = run_distributed(_ddp_and_groups, 4)
    for rank, res in enumerate(results):
        dp, dsp = ((0, 2), (1, 3))[rank % 2], ((0, 1), (2, 3))[rank // 2]
        assert res["dp"] == dp and res["dsp"] == dsp
        records = res["records"]
        ddp = [r for r in records if r[0] == "all_reduce" and r[2] == dp]
        # DDP's reducer: every gradient byte all-reduced once over the DP group, in backward
        assert ddp and all(r[1] == "backward" for r in ddp), records
        assert sum(r[3] for r in ddp) == 2 * res["param_bytes"] * (2 - 1) // 2 == 60
        # the switch: [2, 5, 6, 4] fp32 shard, S split in two: half of it leaves, half arrives
        shard_bytes = 2 * 5 * 6 * 4 * 4
        assert ("all_to_all", "forward", dsp, shard_bytes // 2, shard_bytes // 2) in records
        # the functional all-reduce of 6 floats over the DSP group
        assert ("all_reduce", "forward", dsp, 24, 24) in records and res["y"] == [2.0] * 6
        # point-to-point (P2POp without a group: the world): 12 bytes out, 12 in
        world = (0, 1, 2, 3)
        assert ("send", "forward", world, 12, 0) in records and ("recv", "forward", world, 0, 12) in records
        # all_gather sends its 24 bytes to each of the 3 others; reduce_scatter keeps a quarter of its 96 bytes
        assert ("all_gather", "forward", world, 24 * 3, 24 * 3) in records, \
            f"all_gather bytes at N=4 are not input * (N - 1) = 72: {[r for r in records if r[0] == 'all_gather']}"
        assert ("reduce_scatter", "forward", world, 96 - 24, 96 - 24) in records, \
            f"reduce_scatter bytes at N=4 are not input - output = 72: " \
            f"{[r for r in records if r[0] == 'reduce_scatter']}"
        assert len(records) == len(ddp) + 6
        assert res["dp_selected"] == len(ddp)
        assert res["by_group"][dp]["bytes_sent"] == 60
        assert res["by_group"][dsp]["count"] == 2
        assert res["inner"] == ["all_to_all"]
        # dsp_plugin.checks' fingerprint exchange is kept apart from the model's traffic
        assert res["checked"] == [("all_gather", "check"), ("all_to_all", "forward")]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_gather_and_scatter_bytes_follow_the_group_size(n: int) -> None:
    """Every all_gather / reduce_scatter operator form, counted from its arguments (no processes): an
    all_gather sends its input to each of the N - 1 others, a reduce_scatter moves all but its 1/N."""
    inp, out = torch.zeros(3, 2), torch.zeros(3 * n, 2)          # 24 bytes in, 24 * N out
    expected = (24 * (n - 1), 24 * (n - 1))
    forms = {
        "c10d._allgather_base_": {"input_tensor": inp, "output_tensor": out},
        "c10d.allgather_": {"input_tensors": [inp], "output_tensors": [[inp] * n]},
        "_c10d_functional.all_gather_into_tensor": {"input": inp},
        "c10d._reduce_scatter_base_": {"input_tensor": out, "output_tensor": inp},
        "c10d.reduce_scatter_": {"input_tensors": [[inp] * n], "output_tensors": [inp]},
        "_c10d_functional.reduce_scatter_tensor": {"input": out},
    }
    for key, args in forms.items():
        op, count = OPS[key]
        assert count(args, n, 1) == expected, \
            f"{key} ({op}) at N={n}: bytes (sent, received) = {count(args, n, 1)}, expected {expected}"


def test_nothing_in_torch_is_patched() -> None:
    before = dict(vars(ProcessGroup))
    with CommAccounting():
        assert dict(vars(ProcessGroup)) == before
    assert dict(vars(ProcessGroup)) == before

