"""No silent wrong result and no hang on the users' own paths (issue 16), on two gloo ranks.

One test per reproduced case: a DSP-aware model with no topology installed
(it used to shard over the whole world while the framework reduced its own
way), a guard blind to a permutation, groups that ignored the user's timeout, a
model sharded on some ranks only (deadlock), a parameter used on one rank
only (gloo abort), and teardown. The DeepSpeed ones live in
``test_reliability_deepspeed.py``, the launch ones in ``test_reliability_launch.py``.
Every multi-process test is bounded by ``run_distributed``'s timeout, so a
hang fails instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch

from tests.distributed import WorkerError, run_distributed


# --- case 1: group=None without a topology refuses on every rank ------------------------------------------


def _no_topology(rank: int, world_size: int) -> dict[str, str]:
    from dsp_plugin import Topology, dynamic_switch, gather, reduce_gradients, set_topology, split
    from dsp_plugin.comm import NoTopologyError

    set_topology(None)
    out = {}
    x = torch.randn(2, 4, 6)
    lin = torch.nn.Linear(6, 6)
    lin(x).sum().backward()
    for name, call in (("split", lambda: split(x, 1)), ("dynamic_switch", lambda: dynamic_switch(x, 1, 2)),
                       ("gather", lambda: gather(x, 1)), ("reduce_gradients", lambda: reduce_gradients(
                           lin.parameters()))):
        try:
            call()
            out[name] = "no error"
        except NoTopologyError as exc:
            out[name] = str(exc)
    set_topology(Topology.world())             # the explicit way to say "the world is the DSP group"
    out["world"] = str(tuple(split(x, 1).shape))
    return out


def test_group_none_without_topology_refuses_on_every_rank() -> None:
    results = run_distributed(_no_topology, 2)
    print(results[0]["split"])
    for rank, out in enumerate(results):
        for name in ("split", "dynamic_switch", "gather", "reduce_gradients"):
            message = out[name]
            assert message.startswith(f"{name}: group=None means the DSP group of the installed topology"), \
                (rank, name, message)
            assert "set_topology(dsp_plugin.Topology.build(dsp=N))" in message and "group=" in message
            assert '"sequence_parallel_mode": "dsp"' in message
        assert out["world"] == "(2, 2, 6)", out


def test_config_near_miss_keys_are_named() -> None:
    from dsp_plugin.deepspeed.config import parse_dsp_config, require_dsp_config

    with pytest.raises(ValueError, match="unknown key 'sequence_paralel_mode'; did you mean 'sequence_parallel_mode'"):
        parse_dsp_config({"sequence_paralel_mode": "dsp", "sequence_parallel_size": 2})
    with pytest.raises(ValueError, match="unknown key 'sequence_parallel_sise'; did you mean 'sequence_parallel_size'"):
        parse_dsp_config({"sequence_parallel_mode": "dsp", "sequence_parallel_sise": 2})
    assert parse_dsp_config({"sequence_parallel_size": 2, "train_batch_size": 4}) is None  # DeepSpeed's own SP
    with pytest.raises(ValueError, match="trains with DSP, but the config has no 'sequence_parallel_mode' key"):
        require_dsp_config({"sequence_parallel_size": 2}, who="dsp_plugin.launch.train_deepspeed")


# --- case 5: groups inherit the world's timeout; a late peer is reported within it ----------------------------


def _late_peer(rank: int, world_size: int, late_s: float) -> dict[str, Any]:
    from dsp_plugin import Topology, dynamic_switch, set_topology

    topology = Topology.build()
    set_topology(topology)
    given = Topology.build(timeout=datetime.timedelta(seconds=42))
    cpu = torch.device("cpu")
    out: dict[str, Any] = {"inherited": topology.dsp_group._get_backend(cpu).options._timeout.total_seconds(),
                           "given": given.dsp_group._get_backend(cpu).options._timeout.total_seconds()}
    x = torch.randn(2, 3, 4)
    dynamic_switch(x, 1, 2, global_len=6)          # first call: the signature is agreed here
    if rank == 1:
        time.sleep(late_s)                         # a frozen peer
    start = time.monotonic()
    try:
        dynamic_switch(x, 1, 2, global_len=6)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["waited_s"] = time.monotonic() - start
    return out


def test_dsp_groups_inherit_the_world_timeout_and_report_a_late_peer() -> None:
    # world timeout 3 s; rank 1 arrives 12 s late. Under torch's 30-minute default rank 0 waits and succeeds.
    results = run_distributed(_late_peer, 2, 12.0, collective_timeout_s=3, final_barrier=False, timeout=90)
    print(f"rank 0 waited {results[0]['waited_s']:.1f} s: {results[0]['error']}")
    for out in results:
        assert out["inherited"] == 3.0 and out["given"] == 42.0, out
    assert results[0]["error"] is not None, "rank 0 waited for the late peer: the group ignored the world timeout"


# --- case 2: the guard's fingerprint ------------------------------------------------------------------------


def test_guard_fingerprint_sees_a_permutation_and_is_nan_safe() -> None:
    from dsp_plugin.deepspeed.guard import input_fingerprint

    x = torch.arange(24.0).view(2, 3, 4)
    fp = input_fingerprint((x, torch.tensor([3, 5])), {})
    assert input_fingerprint((x.flip(1), torch.tensor([3, 5])), {}) != fp           # same sums, other order
    assert input_fingerprint((x, torch.tensor([5, 3])), {}) != fp
    assert input_fingerprint((x.clone(), torch.tensor([3, 5])), {}) == fp
    nan = x.clone()
    nan[0, 1, 2] = float("nan")
    assert input_fingerprint((nan,), {}) == input_fingerprint((nan.clone(),), {})    # identical inputs with NaN
    assert input_fingerprint((nan,), {}) != input_fingerprint((x,), {})


def test_guard_verdict_checks_every_dsp_group() -> None:
    from dsp_plugin import checks
    from dsp_plugin.deepspeed.guard import _verdict
    from dsp_plugin.topology import Topology, rank_layout

    topology = Topology(tp=1, dsp=2, dp=2, pp=1, rank=0, world_size=4, layout=rank_layout(4, dsp=2))
    g = checks.GUARD_MAGIC
    assert _verdict([[g, 3, 7], [g, 3, 7], [g, 3, 9], [g, 3, 9]], topology) is None
    message = _verdict([[g, 3, 7], [g, 3, 7], [g, 3, 9], [g, 3, 8]], topology)
    assert message is not None and "inputs differ inside DSP group(s) [[2, 3]]" in message
    message = _verdict([[g, 3, 7], [g, 3, 7], [g, 0, 9], [g, 0, 9]], topology)
    assert message is not None and "no DSP split or switch on rank(s) [2, 3]" in message


# --- case 4: a parameter used on one rank only ------------------------------------------------------------------


class OwnedToken(torch.nn.Module):
    """Frames ``[B, T, D]``; a learned token added to frame 0 only (so only the rank holding it uses it)."""

    def __init__(self, dsp: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dsp = dsp
        self.lin = torch.nn.Linear(4, 4)
        self.token = torch.nn.Parameter(torch.randn(4))
        self.head = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Parameter(torch.randn(3))   # no rank uses it: no gradient anywhere, as on one process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dsp_plugin import gather, split
        from dsp_plugin.comm import group_rank

        h = split(x, 1) if self.dsp else x
        h = self.lin(h)
        if not self.dsp or group_rank() == 0:        # frame 0 lives on DSP rank 0
            h = torch.cat([h[:, :1] + self.token, h[:, 1:]], dim=1)
        h = self.head(torch.relu(h))
        return gather(h, 1) if self.dsp else h


def _owned_token(rank: int, world_size: int) -> dict[str, Any]:
    from dsp_plugin import reduce_gradients

    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
    model = OwnedToken(dsp=True)
    model(x).square().mean().backward()
    had = {n: p.grad is not None for n, p in model.named_parameters()}
    reduce_gradients(model.named_parameters())
    # numpy, not tensors: tensors would travel through file descriptors that die with the worker
    return {"had": had, "grads": {n: None if p.grad is None else p.grad.numpy().copy()
                                  for n, p in model.named_parameters()}}


def test_parameter_used_on_one_rank_reduces_as_zeros() -> None:
    results = run_distributed(_owned_token, 2)
    assert results[0]["had"]["token"] and not results[1]["had"]["token"], "the test needs a rank-owned token"
    reference = OwnedToken(dsp=False)
    reference(torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    for rank, out in enumerate(results):
        for name, p in reference.named_parameters():
            if p.grad is None:
                assert out["grads"][name] is None, (rank, name)
            else:
                torch.testing.assert_close(torch.from_numpy(out["grads"][name]), p.grad, rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}: {name}")


def _mismatched_parameters(rank: int, world_size: int) -> str:
    from dsp_plugin import reduce_gradients

    model = torch.nn.Linear(4, 4 if rank == 0 else 3)
    model(torch.ones(1, 4)).sum().backward()
    try:
        reduce_gradients(model.named_parameters())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_reduce_gradients_names_a_parameter_the_ranks_disagree_on() -> None:
    results = run_distributed(_mismatched_parameters, 2)
    assert results[0] == results[1], results
    assert results[0].startswith("reduce_gradients: parameter weight differs across group [0, 1]"), results[0]
    assert "16 elements on rank 0, 12 elements on rank 1" in results[0]


# --- case 6: a model sharded on some ranks only ------------------------------------------------------------------


def _sharded_on_rank0_only(rank: int, world_size: int) -> str:
    from dsp_plugin import Topology, reduce_gradients, set_topology

    set_topology(Topology.build())   # its DSP group and DP x DSP group are two group objects
    model = OwnedToken(dsp=rank == 0)
    try:
        model(torch.randn(2, 5, 4)).sum().backward()
        reduce_gradients(model.parameters())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_model_sharded_on_some_ranks_only_fails_clearly_on_every_rank() -> None:
    results = run_distributed(_sharded_on_rank0_only, 2, collective_timeout_s=20, timeout=120)
    print("\n".join(results))
    assert "rank 1 is in reduce_gradients" in results[0], results[0]
    assert "rank(s) [0] of group [0, 1] are inside a DSP primitive" in results[1], results[1]


# --- case 9: teardown ---------------------------------------------------------------------------------------------


def _sample_fails(rank: int, world_size: int) -> dict[str, Any]:
    from dsp_plugin.launch import sample_latte
    from dsp_plugin.topology import get_topology

    try:
        sample_latte.main(["--frames", "1", "--steps", "1", "--layers", "1"])
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "topology_left": get_topology() is not None}


def test_sample_latte_clears_its_topology_on_error() -> None:
    try:
        results = run_distributed(_sample_fails, 2, timeout=180)
    except WorkerError as exc:  # pragma: no cover - shown on failure
        raise AssertionError(str(exc)) from None
    for out in results:
        assert "video_length=1 is smaller than the DSP size 2" in out["error"], out
        assert not out["topology_left"], "sample_latte left its topology installed after an error"
