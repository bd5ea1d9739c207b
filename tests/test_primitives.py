"""split / gather / dynamic_switch against the full tensor chunked per rank (bit-exact).

Every worker builds the same full tensor from a seed, so the expected shard of
any placement is ``full.tensor_split(n, dim)[rank]`` computed locally.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsp_plugin import dynamic_switch, gather, split
from dsp_plugin.accounting import CommAccounting
from tests.distributed import run_distributed

# (shape, dims that get sharded) — even, uneven (T=7, S=13), 3 sequence dims, 2-dim tensors
SHAPES = [
    ((2, 8, 12, 3), (1, 2)),
    ((1, 7, 13, 2), (1, 2)),
    ((2, 5, 6, 7, 3), (1, 2, 3)),
    ((9, 4), (0, 1)),
]


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _chunk(t: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    return t.tensor_split(n, dim=dim)[rank]


def _forward_and_backward(rank: int, n: int) -> int:
    checks = 0
    for case, (shape, dims) in enumerate(SHAPES):
        full = _full(shape, case)
        grad_full = _full(shape, 100 + case)
        for cur in dims:
            # split: R -> S(cur); backward gathers the gradient
            x = full.clone().requires_grad_(True)
            y = split(x, tgt_shard=cur)
            assert torch.equal(y, _chunk(full, cur, n, rank)), (shape, cur)
            y.backward(_chunk(grad_full, cur, n, rank))
            assert torch.equal(x.grad, grad_full), ("split backward", shape, cur)
            # gather: S(cur) -> R (negative dim spelling); backward keeps the local chunk
            shard = _chunk(full, cur, n, rank).clone().requires_grad_(True)
            z = gather(shard, cur_shard=cur - len(shape), global_len=shape[cur])
            assert torch.equal(z, full), ("gather", shape, cur)
            z.backward(grad_full)
            assert torch.equal(shard.grad, _chunk(grad_full, cur, n, rank)), ("gather backward", shape, cur)
            # without global_len the length is recovered from the group
            assert torch.equal(gather(_chunk(full, cur, n, rank), cur), full)
            for tgt in dims:
                if tgt == cur:
                    continue
                shard = _chunk(full, cur, n, rank).clone().requires_grad_(True)
                out = dynamic_switch(shard, cur_shard=cur, tgt_shard=tgt, global_len=shape[cur])
                assert torch.equal(out, _chunk(full, tgt, n, rank)), ("switch", shape, cur, tgt)
                out.backward(_chunk(grad_full, tgt, n, rank))
                assert torch.equal(shard.grad, _chunk(grad_full, cur, n, rank)), ("switch bwd", shape, cur, tgt)
                # round trip: a switch and its inverse give back the shard
                back = dynamic_switch(out.detach(), tgt, cur, global_len=shape[tgt])
                assert torch.equal(back, _chunk(full, cur, n, rank))
                assert torch.equal(dynamic_switch(_chunk(full, cur, n, rank), cur, tgt), out.detach())
                checks += 1
            # round trip: gather of split
            assert torch.equal(gather(split(full, cur), cur, global_len=shape[cur]), full)
    return checks


@pytest.mark.parametrize("world_size", [2, 4])
def test_primitives_bit_exact(world_size: int) -> None:
    checks = run_distributed(_forward_and_backward, world_size)
    assert checks == [2 + 2 + 6 + 2] * world_size  # ordered (cur, tgt) pairs over SHAPES


def _collective_counts(rank: int, n: int) -> dict[str, object]:
    shape = (2, 7, 13, 4)
    shard = _chunk(_full(shape, 0), 1, n, rank).contiguous().requires_grad_(True)
    with CommAccounting() as first:       # a new signature: the ranks agree first (dsp_plugin.checks)
        dynamic_switch(shard.detach(), 1, 2, global_len=7)
    with CommAccounting() as acct:
        out = dynamic_switch(shard, 1, 2, global_len=7)
        out.sum().backward()
    # the ProcessGroup methods accounting wrapped work again as before once it is gone
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.barrier()
    return {
        "after": total.item(),
        "first": [(r.op, r.phase) for r in first.check_records + first.records],
        "records": [(r.op, r.phase) for r in acct.records],
        "sent": acct.bytes_sent("all_to_all", "forward"),
        "received": acct.bytes_received("all_to_all", "forward"),
    }


def test_switch_is_one_all_to_all_each_way() -> None:
    n = 4
    results = run_distributed(_collective_counts, n)
    itemsize = 8
    t_sizes = [2, 2, 2, 1]    # tensor_split(7, 4)
    s_sizes = [4, 3, 3, 3]    # tensor_split(13, 4)
    for rank, res in enumerate(results):
        # the fingerprint exchange (kept apart in check_records), then the switch
        assert res["first"] == [("all_gather", "check"), ("all_to_all", "forward")]
        assert res["records"] == [("all_to_all", "forward"), ("all_to_all", "backward")]
        assert res["after"] == n
        # rank sends its T-chunk of every other rank's S-chunk
        sent = sum(2 * t_sizes[rank] * s * 4 * itemsize for j, s in enumerate(s_sizes) if j != rank)
        received = sum(2 * t * s_sizes[rank] * 4 * itemsize for i, t in enumerate(t_sizes) if i != rank)
        assert res["sent"] == sent and res["received"] == received


def test_single_process_is_identity() -> None:
    assert not dist.is_initialized()
    x = torch.randn(2, 3, 4)
    with CommAccounting() as acct:
        assert split(x, 1) is x
        assert gather(x, 1) is x
        assert dynamic_switch(x, 1, 2) is x
    assert acct.records == []


def _size_one_group(rank: int, n: int) -> list[object]:
    own = [dist.new_group([r]) for r in range(n)][rank]
    x = torch.randn(2, 3, 4)
    with CommAccounting() as acct:
        same = [split(x, 1, group=own) is x, gather(x, 2, group=own) is x,
                dynamic_switch(x, 1, 2, group=own) is x]
    return same + [len(acct.records)]


def test_size_one_group_issues_no_collective() -> None:
    for res in run_distributed(_size_one_group, 2):
        assert res == [True, True, True, 0]
