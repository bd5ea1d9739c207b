"""What ``initialize`` refuses, and the first-forward guard, on two real ranks.

Refused before any process group of ours exists: a pipeline model. Caught by
the guard at the first forward, with the same message on every rank and no
rank left waiting: a model that never shards (it would train with gradients
DSP times too large) and inputs that differ inside a DSP group. One spawn runs
all three in turn on the same two processes, so a rank that hung in one case
would time the whole test out.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deepspeed_harness import ds_config, dsp_model, global_batch, loss_fn, make_model, setup_worker
from tests.distributed import run_distributed


def guard_worker(rank: int, world_size: int) -> dict[str, Any]:
    setup_worker(rank, world_size)
    import deepspeed
    import torch

    from dsp_plugin.checks import InputMismatch
    from dsp_plugin.deepspeed import DSPGuardError, initialize, skip_cpu_shm_build
    from dsp_plugin.topology import get_topology, set_topology

    set_topology(None)  # the runner installs Topology.world(); initialize must build none before refusing
    out: dict[str, Any] = {}
    # A PipelineModule needs DeepSpeed's communication backend, as in a real pipeline script.
    skip_cpu_shm_build()
    deepspeed.comm.init_distributed(dist_backend="gloo")
    pipe = deepspeed.pipe.PipelineModule(layers=[torch.nn.Linear(2, 2)], num_stages=1)
    try:
        initialize(model=pipe, config=ds_config(2, 2, micro_batch=1))
    except ValueError as exc:
        out["pipeline"] = str(exc)
    out["topology_after_refusal"] = get_topology()

    # Stage 2: the model was never made DSP-aware (no parallelize).
    engine, *_ = initialize(model=make_model(), config=ds_config(2, 2, micro_batch=1, optimizer={
        "type": "SGD", "params": {"lr": 0.1}}))
    try:
        loss_fn(engine, global_batch(0, 1))
    except DSPGuardError as exc:
        out["unsharded"] = str(exc)
    engine.destroy()

    # Stage 3: a DSP-aware model, but each rank of the DSP group gets another sample. The parallelized model's
    # own entry check (InputMismatch) fires before the guard's end-of-forward verdict; either must refuse.
    engine, *_ = initialize(model=dsp_model(), config=ds_config(3, 2, micro_batch=1, optimizer={
        "type": "SGD", "params": {"lr": 0.1}}))
    try:
        loss_fn(engine, global_batch(rank, 1))
    except (DSPGuardError, InputMismatch) as exc:
        out["inputs"] = str(exc)
    # The guard removed itself: the same engine trains on identical inputs afterwards.
    engine.backward(loss_fn(engine, global_batch(0, 1)))
    engine.step()
    engine.destroy()
    return out


@pytest.mark.slow
def test_refusals_and_guard_on_every_rank() -> None:
    results = run_distributed(guard_worker, 2, timeout=300)
    for key, what in (("pipeline", "initialize did not refuse the pipeline model"),
                      ("unsharded", "the guard did not fire on a model that never shards"),
                      ("inputs", "the guard did not fire on inputs that differ inside the DSP group")):
        missing = [rank for rank, out in enumerate(results) if key not in out]
        assert not missing, f"{what} (no error on rank(s) {missing})"
        print(results[0][key])
    for rank, out in enumerate(results):
        assert "does not support DeepSpeed's pipeline engine" in out.get("pipeline", ""), (rank, out)
        assert out["topology_after_refusal"] is None, f"rank {rank}: groups were built before the refusal"
        assert "the first forward issued no DSP split or switch on rank(s) [0, 1]" in out.get("unsharded", ""), \
            (rank, out)
        assert "training with gradients 2x too large" in out["unsharded"]
        assert "dsp_plugin.parallelize(model)" in out["unsharded"]
        inputs = out.get("inputs", "")
        assert ("inputs differ inside DSP group(s) [[0, 1]]" in inputs
                or "the inputs differ across the 2 ranks of group [0, 1]: latents" in inputs), (rank, out)
    assert results[0]["unsharded"] == results[1]["unsharded"]


def test_the_guard_judges_every_dsp_group() -> None:
    """DSP=2 x DP=2 (groups [0, 1] and [2, 3]), without processes: the verdict every rank computes from the
    all-gathered rows (sharded calls, input fingerprint) names the group whose inputs differ, whichever it is."""
    import torch

    from dsp_plugin.checks import GUARD_MAGIC
    from dsp_plugin.deepspeed.guard import _verdict, input_fingerprint
    from dsp_plugin.topology import Topology, rank_layout

    topology = Topology(tp=1, dsp=2, dp=2, pp=1, rank=0, world_size=4, layout=rank_layout(4, dsp=2))
    assert topology.layout["dsp"] == [[0, 1], [2, 3]]
    samples = [torch.arange(6.0), torch.arange(6.0), torch.ones(6), torch.ones(6)]  # one sample per DSP group

    def rows(inputs: list[torch.Tensor]) -> list[list[int]]:  # [magic, sharded calls, input fingerprint]
        return [[GUARD_MAGIC, 1, input_fingerprint((x,), {})] for x in inputs]

    assert _verdict(rows(samples), topology) is None
    for group in ([0, 1], [2, 3]):
        inputs = list(samples)
        inputs[group[1]] = inputs[group[1]] + 1          # the second rank of this group gets another sample
        message = _verdict(rows(inputs), topology)
        assert message is not None and f"inputs differ inside DSP group(s) [{group}]" in message, \
            f"the guard missed inputs that differ inside DSP group {group} of {topology.layout['dsp']}: {message!r}"
