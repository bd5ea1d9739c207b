"""design.md §7: every user error raises a clear message on every rank, before any collective."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from dsp_plugin import dynamic_switch, gather, split
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.checks import set_check_mode
from tests.distributed import run_distributed

# (call, expected message). On one process the error is raised at once; on a group it
# is raised after the ranks' fingerprint exchange (dsp_plugin.checks), on every rank,
# so no peer is left in a collective whatever the other ranks passed.
CATALOGUE = [
    (lambda x: dynamic_switch(x, cur_shard=2, tgt_shard=2),
     "dynamic_switch: cur_shard=2 equals tgt_shard=2"),
    (lambda x: dynamic_switch(x, cur_shard=1, tgt_shard=-2),
     "dynamic_switch: cur_shard=1 equals tgt_shard=-2 (both are dim 1"),
    (lambda x: dynamic_switch(x, 1, 3), "dynamic_switch: tgt_shard=3 is out of range for a tensor with 3 dims"),
    (lambda x: split(x, tgt_shard=-4), "split: tgt_shard=-4 is out of range for a tensor with 3 dims"),
    (lambda x: gather(x, cur_shard=5), "gather: cur_shard=5 is out of range"),
    (lambda x: split(x, tgt_shard=1.0), "split: tgt_shard must be an int, got 1.0"),
    (lambda x: split(x.numpy(), 1), "split: expected a torch.Tensor, got ndarray"),
    (lambda x: gather(x.sum(), 0), "gather: expected a tensor with at least 1 dim"),
    (lambda x: dynamic_switch(x, 1, 2, global_len=-1), "dynamic_switch: global_len must be a non-negative int"),
]


def _catalogue(rank: int, n: int) -> list[str]:
    x = torch.zeros(2, 4, 6)
    messages = []
    with CommAccounting() as acct:
        for call, _ in CATALOGUE:
            try:
                call(x)
                messages.append("no error")
            except (TypeError, ValueError) as exc:
                messages.append(str(exc))
    # an error path issues at most the small fingerprint exchange, never a data collective
    assert acct.records == [], acct.records
    assert all(r.op == "all_gather" and r.bytes_sent < 1024 for r in acct.check_records), acct.check_records
    return messages


@pytest.mark.parametrize("world_size", [1, 2])
def test_catalogue_raises_on_every_rank_before_any_collective(world_size: int) -> None:
    for messages in run_distributed(_catalogue, world_size):
        for message, (_, expected) in zip(messages, CATALOGUE):
            assert expected in message, (expected, message)


def _wrong_global_len(rank: int, n: int, mode: str) -> str:
    # 7 frames on 2 ranks (4 + 3), but both claim global_len=6 (3 + 3): only rank 0 can
    # tell locally. The fingerprint exchange shows it to both, and both raise.
    set_check_mode(mode)
    shard = torch.zeros(1, 4 - rank, 6)
    try:
        dynamic_switch(shard, 1, 2, global_len=6)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_global_len_that_does_not_match_the_shard() -> None:
    messages = run_distributed(_wrong_global_len, 2, "first")
    assert messages == ["CrossRankMismatch: dynamic_switch: rank 0 holds 4 of dim 1, but global_len=6 split over "
                        "2 ranks gives it 3 (local lengths [4, 3], expected [3, 3])"] * 2


def test_global_len_that_does_not_match_the_shard_without_checks() -> None:
    # DSP_CHECK=0: rank 0 raises alone; rank 1 enters the all-to-all alone and must fail
    # as soon as rank 0 is gone, not hang.
    messages = run_distributed(_wrong_global_len, 2, "off", final_barrier=False)
    assert messages[0] == ("ValueError: dynamic_switch: rank 0 holds 4 of dim 1, but global_len=6 "
                           "split over 2 ranks gives it 3")
    assert messages[1].startswith("RuntimeError"), messages[1]


def _inconsistent_lengths(rank: int, n: int) -> str:
    # without global_len the group is asked; 5 and 1 are no tensor_split of 6 into 2
    shard = torch.zeros(1, 5 if rank == 0 else 1, 4)
    with pytest.raises(ValueError) as info:
        dynamic_switch(shard, 1, 2)
    return str(info.value)


def test_local_lengths_that_are_no_tensor_split() -> None:
    for message in run_distributed(_inconsistent_lengths, 2):
        assert message == ("dynamic_switch: local lengths of dim 1 across the group are [5, 1], "
                           "which is not a torch.tensor_split of 6 into 2")


def _peer_dies(rank: int, n: int) -> dict[str, object]:
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    if rank == 1:
        return {"skipped": True}          # a rank that never joins the switch
    start = time.monotonic()
    try:
        dynamic_switch(torch.zeros(1, 4, 4), 1, 2, group=group, global_len=8)
        return {"error": None}
    except RuntimeError as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - start}


def test_missing_peer_fails_within_the_timeout_instead_of_hanging() -> None:
    result = run_distributed(_peer_dies, 2, timeout=120)[0]
    assert result["error"] == "RuntimeError"
    assert result["seconds"] < 60
