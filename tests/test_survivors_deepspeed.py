"""The DeepSpeed guard and checkpoints in the states a long run reaches, which a fresh process does not.

Issue 29's survivors 3, 7, 8 and 10, on two real ranks of one spawn (DeepSpeed engines on gloo):

- the guard judges each engine's first forward by what that forward did: after a
  DSP-aware engine trained in the same process (its ``split`` calls counted), an
  unsharded model must still be refused (else it trains with gradients 2x too large);
- the guard is gone after the first forward: later steps exchange no fingerprint
  (``CommAccounting.check_records`` is empty), whatever its hooks look like;
- two saves of the same step get two tags (a save never writes into another's directory),
  and both ranks save under the same tag;
- ``latest`` is written only after every rank's manifest: with rank 1 slow to hash its
  files (a slow filesystem), ``check_load_dir`` on rank 0 right after ``save`` returns
  finds a complete checkpoint. Were ``latest`` written first, a save interrupted on a
  slow rank would become ``latest`` and the next load would refuse it, although the
  earlier save is complete.

The assertions are about behaviour, not the guard's lines (issue 25 item 13 reorders them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.deepspeed_harness import ds_config, dsp_model, global_batch, loss_fn, make_model, setup_worker
from tests.distributed import run_distributed

SGD = {"type": "SGD", "params": {"lr": 0.1}}
SLOW_HASH_S = 1.0   # rank 1's extra time per file hashed while saving


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    setup_worker(rank, world_size)
    import dsp_plugin.deepspeed.checkpoint as checkpoint
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import sharded_calls
    from dsp_plugin.deepspeed import DSPGuardError, initialize

    out: dict[str, Any] = {}
    # 1. a DSP-aware engine, three steps: the guard checks the first forward, and only it
    engine, *_ = initialize(model=dsp_model(), config=ds_config(2, 2, micro_batch=1, optimizer=SGD))
    out["checks_per_step"] = []
    for step in range(3):
        with CommAccounting(activations=False) as acct:
            engine.backward(loss_fn(engine, global_batch(0, 1)))
            engine.step()
        out["checks_per_step"].append(len(acct.check_records))
    # 2. the same step saved twice, then a save with rank 1 slow to hash its files
    out["tags"] = [checkpoint.save(engine, Path(root) / "twice", step=3) for _ in range(2)]
    if rank == 1:
        original = checkpoint._hash

        def slow_hash(path: Path) -> str:
            time.sleep(SLOW_HASH_S)
            return original(path)

        checkpoint._hash = slow_hash
    try:
        tag = checkpoint.save(engine, Path(root) / "slow", step=4)
    finally:
        if rank == 1:
            checkpoint._hash = original
    if rank == 0:  # what a restart reading the directory right now would load
        try:
            out["slow_save_loads"] = checkpoint.check_load_dir(Path(root) / "slow")[0] == tag
        except checkpoint.CheckpointError as exc:
            out["slow_save_loads"] = str(exc)
    engine.destroy()
    # 3. an unsharded model in the same process, after split ran there
    out["sharded_calls_before"] = sharded_calls()
    engine, *_ = initialize(model=make_model(), config=ds_config(2, 2, micro_batch=1, optimizer=SGD))
    try:
        loss_fn(engine, global_batch(0, 1))
        out["unsharded"] = "no error"
    except DSPGuardError as exc:
        out["unsharded"] = str(exc)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_the_guard_refuses_an_unsharded_model_after_split_ran_in_the_process(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        assert out["sharded_calls_before"] > 0, out
        assert "the first forward issued no DSP split or switch on rank(s) [0, 1]" in out["unsharded"], (
            f"rank {rank}: an unsharded model initialized after a DSP-aware one ({out['sharded_calls_before']} "
            f"split/switch calls earlier in the process) was not refused by the guard ({out['unsharded']!r}); "
            f"it would train with gradients 2x too large")


def test_the_guard_is_gone_after_the_first_forward(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        first, *later = out["checks_per_step"]
        assert first > 0, out
        assert later == [0, 0], (
            f"rank {rank}: fingerprint exchanges per step {out['checks_per_step']}; after the first forward the "
            f"guard must remove itself (no exchange, no input hashed on the host in later steps)")


def test_two_saves_of_one_step_get_two_tags_alike_on_every_rank(results: list[dict[str, Any]]) -> None:
    first, second = results[0]["tags"]
    assert first != second, (f"two saves of step 3 both went to tag {first!r}: the second writes over the first's "
                             f"files; each save needs its own tag")
    assert results[1]["tags"] == results[0]["tags"], (f"the ranks saved step 3 under different tags: rank 0 "
                                                      f"{results[0]['tags']}, rank 1 {results[1]['tags']}")


def test_latest_waits_for_every_rank_of_a_slow_save(results: list[dict[str, Any]]) -> None:
    assert results[0]["slow_save_loads"] is True, (
        f"right after save returned on rank 0, with rank 1 still hashing its files, the checkpoint 'latest' names "
        f"does not load: {results[0]['slow_save_loads']!r}; latest must be written after every rank's manifest")
