"""Cross-rank agreement (dsp_plugin.checks): inputs that differ between ranks fail alike on every rank.

Each row is a mistake a distributed user makes that only shows across ranks.
Before the checks these ended in a gloo abort, a hang until the group timeout, or
a silently wrong tensor; now every rank raises the same clear error within
seconds, and the group stays usable afterwards (no data collective ran).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dsp_plugin import dynamic_switch, gather, split
from dsp_plugin.checks import CrossRankMismatch, forget_signatures, set_check_mode
from tests.distributed import COLLECTIVE_TIMEOUT_S, run_distributed


def _rows(rank: int) -> dict[str, object]:
    """name -> a call that differs between rank 0 and rank 1."""
    f32 = torch.zeros(2, 4, 6)
    return {
        "global_len differs": lambda: dynamic_switch(torch.zeros(1, 4, 6), 1, 2, global_len=8 - rank),
        "other dim differs": lambda: dynamic_switch(torch.zeros(2, 4, 6 + 2 * rank), 1, 2, global_len=8),
        "same numel, other shape (gather)": lambda: gather(torch.zeros(2, 3, 4) if rank == 0
                                                           else torch.zeros(2, 4, 3), 1),
        "dtype f32 vs f64": lambda: dynamic_switch(f32 if rank == 0 else f32.double(), 1, 2, global_len=8),
        "dtype f32 vs bf16": lambda: gather(f32 if rank == 0 else f32.bfloat16(), 1, global_len=8),
        "dims disagree": lambda: dynamic_switch(f32, 1 + rank, 2 - rank, global_len=8),
        "one rank's own error": lambda: dynamic_switch(f32, 1, 1 + rank, global_len=8),
        "split dim differs": lambda: split(f32, 1 + rank),
    }


EXPECTED = {
    "global_len differs": "the full length of dim 1 (global_len) is 8 on rank 0, 7 on rank 1",
    "other dim differs": "the shape (sharded dim as -1) is (2, -1, 6) on rank 0, (2, -1, 8) on rank 1",
    "same numel, other shape (gather)": "the shape (sharded dim as -1) is (2, -1, 4) on rank 0, (2, -1, 3) on rank 1",
    "dtype f32 vs f64": "dtype is torch.float32 on rank 0, torch.float64 on rank 1",
    "dtype f32 vs bf16": "dtype is torch.float32 on rank 0, torch.bfloat16 on rank 1",
    "dims disagree": "the sharded input dim is 1 on rank 0, 2 on rank 1",
    "one rank's own error": "rank(s) [0] of group [0, 1] rejected their input before the collective",
    "split dim differs": "the target dim is 1 on rank 0, 2 on rank 1",
}


def _run_rows(rank: int, n: int, mode: str) -> dict[str, object]:
    set_check_mode(mode)
    out: dict[str, object] = {}
    for name, call in _rows(rank).items():
        # each row is a program of its own: in `first` mode a signature one rank saw in an
        # earlier row would otherwise skip the check there (a mismatch that appears mid-run
        # is what `always` is for)
        forget_signatures()
        start = time.monotonic()
        try:
            call()
            out[name] = ("no error", 0.0)
        except (ValueError, TypeError) as exc:
            out[name] = (f"{type(exc).__name__}: {exc}", time.monotonic() - start)
    # the group still works: no data collective ran with mismatched arguments
    x = torch.arange(8.0).view(1, 8, 1).tensor_split(n, 1)[rank].contiguous()
    out["after"] = gather(x, 1, global_len=8).flatten().tolist()
    return out


@pytest.mark.parametrize("mode", ["always", "first"])
def test_every_row_fails_alike_on_every_rank(mode: str) -> None:
    results = run_distributed(_run_rows, 2, mode)
    for name, expected in EXPECTED.items():
        messages = [r[name][0] for r in results]
        assert messages[0] == messages[1], (name, messages)        # the same error on every rank
        assert messages[0].startswith("CrossRankMismatch"), (name, messages[0])
        assert expected in messages[0], (name, messages[0])
        assert max(r[name][1] for r in results) < COLLECTIVE_TIMEOUT_S / 4, name   # not a timeout
    assert results[1]["one rank's own error"][0].endswith(
        "rank 0: ValueError: dynamic_switch: cur_shard=1 equals tgt_shard=1 (both are dim 1 of a 3-dim tensor); "
        "expected two different dims")
    for r in results:
        assert r["after"] == [float(i) for i in range(8)]


def _not_a_member(rank: int, n: int) -> str:
    only_zero = dist.new_group([0])
    try:
        out = split(torch.zeros(2, 4), 1, group=only_zero)
        return "identity" if out.shape == (2, 4) else "wrong"
    except ValueError as exc:
        return str(exc)


def test_a_group_the_rank_is_not_in() -> None:
    member, outsider = run_distributed(_not_a_member, 2)
    assert member == "identity"   # a group of size 1 on rank 0
    assert outsider == ("split: this process (global rank 1) is not a member of the group it was given "
                        "(ranks [0]); expected a group that contains this rank, or group=None for the DSP group")


def _numpy_dims(rank: int, n: int) -> bool:
    x = torch.arange(24.0).view(2, 4, 3)
    shard = split(x, np.int64(1))
    back = gather(dynamic_switch(shard, np.int64(1), np.int32(2)), np.int64(2))
    return torch.equal(back, x)


def test_numpy_integers_are_dims() -> None:
    assert run_distributed(_numpy_dims, 2) == [True, True]


def _unknown_length_recovered(rank: int, n: int) -> list[object]:
    # no tag and no global_len: the check exchange recovers the full length (7 = 4 + 3)
    set_check_mode("first")
    shard = torch.arange(7.0).view(1, 7, 1).tensor_split(n, 1)[rank].contiguous()
    return gather(shard, 1).flatten().tolist()


def test_length_recovered_from_the_group_without_tag() -> None:
    for out in run_distributed(_unknown_length_recovered, 2):
        assert out == [float(i) for i in range(7)]


def test_bad_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="set_check_mode: mode='sometimes'"):
        set_check_mode("sometimes")
    monkeypatch.setenv("DSP_CHECK", "maybe")
    from dsp_plugin.checks import check_mode

    with pytest.raises(ValueError, match="DSP_CHECK='maybe'; expected 1/always, 0/off, or unset/first"):
        check_mode()


def test_default_mode_is_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset (or empty) DSP_CHECK means ``first``: one fingerprint exchange per new signature, none in the
    steady state. ``always`` would add an all-gather and a host sync to every primitive call."""
    from dsp_plugin.checks import check_mode

    set_check_mode(None)                             # no override: the environment decides
    monkeypatch.delenv("DSP_CHECK", raising=False)
    assert check_mode() == "first", f"with DSP_CHECK unset the default check mode is {check_mode()!r}, not 'first'"
    monkeypatch.setenv("DSP_CHECK", "")
    assert check_mode() == "first", f"with DSP_CHECK='' the check mode is {check_mode()!r}, not 'first'"


def test_mismatch_is_a_value_error() -> None:
    assert issubclass(CrossRankMismatch, ValueError)
