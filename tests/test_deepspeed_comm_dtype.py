"""``"sequence_parallel_comm_dtype": "fp8"`` in the DeepSpeed config (issue 28: the FP8 switch payload as a
DeepSpeed setting; Megatron's is ``--dsp-comm-dtype``, tests/test_megatron_precision.py).

The key sets the wire format of every plan runtime in the model ``initialize`` gets; checked before any
collective (a model without a runtime, or parallelized with another ``comm_dtype``, is refused). On 2 gloo
ranks, the tiny STDiT through ``parallelize`` in bf16 under ZeRO-2: each switch sends half the bf16 bytes plus
a 4-byte scale per peer, and the loss stays within 1% of the same run with the bf16 payload at every step.
The key comes from the config at each ``initialize``, not from a checkpoint: an engine resumed from a save
made with it sends fp8 again and continues the uninterrupted loss curve bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.deepspeed_harness import LATENT, ds_config, dsp_model, global_batch, setup_worker  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

STEPS = 4


def _config(**overrides: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_mode": "dsp", "sequence_parallel_size": 2,
            **overrides}


def test_the_key_parses_and_bad_values_are_named() -> None:
    from dsp_plugin.deepspeed import parse_dsp_config

    assert parse_dsp_config(_config(), world_size=2).comm_dtype is None
    assert parse_dsp_config(_config(sequence_parallel_comm_dtype=None), world_size=2).comm_dtype is None
    assert parse_dsp_config(_config(sequence_parallel_comm_dtype="fp8"), world_size=2).comm_dtype == "fp8"
    with pytest.raises(ValueError, match=r"'sequence_parallel_comm_dtype': 'bf16'; expected one of \['fp8'\]"):
        parse_dsp_config(_config(sequence_parallel_comm_dtype="bf16"), world_size=2)
    with pytest.raises(ValueError, match="unknown key 'sequence_parallel_comm_dtpye'; did you mean "
                                         "'sequence_parallel_comm_dtype'"):
        parse_dsp_config(_config(sequence_parallel_comm_dtpye="fp8"), world_size=2)
    with pytest.raises(ValueError, match="needs 'sequence_parallel_mode': 'dsp'"):
        parse_dsp_config({"sequence_parallel_comm_dtype": "fp8"}, world_size=2)


def test_initialize_refuses_a_model_it_cannot_set_before_any_collective() -> None:
    import torch.distributed as dist

    import dsp_plugin
    from dsp_plugin.comm.payload import Payload
    from dsp_plugin.deepspeed import initialize
    from tests.deepspeed_harness import make_model

    config = _config(sequence_parallel_comm_dtype="fp8")
    with pytest.raises(ValueError, match="applies to a model made parallel by dsp_plugin.parallelize, but this "
                                         "Linear has none"):
        initialize(model=torch.nn.Linear(2, 2), config=config)
    other = dsp_plugin.parallelize(make_model(), comm_dtype=Payload(grad=torch.float8_e5m2))
    with pytest.raises(ValueError, match="but the model was parallelized with comm_dtype=Payload"):
        initialize(model=other, config=config)
    assert not dist.is_initialized()


def _fp8_config() -> dict[str, Any]:
    return ds_config(2, 2, micro_batch=2, optimizer={"type": "SGD", "params": {"lr": 0.5}},
                     bf16={"enabled": True}, sequence_parallel_comm_dtype="fp8")


def _train_step(engine: Any, step: int) -> tuple[float, dict[str, list[int]]]:
    """One step on ``global_batch(step, 2)`` in bf16: the loss in fp32 and the all_to_all bytes per phase."""
    from dsp_plugin.accounting import CommAccounting

    batch = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in global_batch(step, 2))
    latents, timestep, text, target = batch
    with CommAccounting(activations=False) as acct:   # the loss in fp32: bf16's ulp would hide the gap
        loss = torch.nn.functional.mse_loss(engine(latents, timestep, text).float(), target.float())
        engine.backward(loss)
    engine.step()
    sent = {phase: [r.bytes_sent for r in acct.records if r.op == "all_to_all" and r.phase == phase]
            for phase in ("forward", "backward")}
    return loss.item(), sent


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    setup_worker(rank, world_size)
    from dsp_plugin.deepspeed import initialize

    out: dict[str, Any] = {}
    for wire in (None, "fp8"):
        extra = {} if wire is None else {"sequence_parallel_comm_dtype": wire}
        config = ds_config(2, 2, micro_batch=2, optimizer={"type": "SGD", "params": {"lr": 0.5}},
                           bf16={"enabled": True}, **extra)
        engine, *_ = initialize(model=dsp_model(), config=config)
        losses, sent = [], None
        for step in range(STEPS):
            loss, step_sent = _train_step(engine, step)
            sent = sent or step_sent
            losses.append(loss)
        out[str(wire)] = {"losses": losses, "sent": sent,
                          "runtime": repr(engine.module._dsp_plan_runtime.comm_dtype)}
        engine.destroy()
    return out


@pytest.mark.slow
def test_fp8_key_halves_the_switch_bytes_and_keeps_the_loss_curve() -> None:
    for rank, d in enumerate(run_distributed(_worker, 2, timeout=600)):
        exact, fp8 = d["None"], d["fp8"]
        assert "float8_e4m3fn" in fp8["runtime"] and exact["runtime"] == "None", (fp8["runtime"], exact["runtime"])
        for phase in ("forward", "backward"):
            sent16, sent8 = exact["sent"][phase], fp8["sent"][phase]
            assert len(sent8) == len(sent16) > 0, (phase, sent8, sent16)
            assert sent8 == [b // 2 + 4 for b in sent16], (phase, sent8, sent16)   # 1 peer: one scale
        gaps = [abs(a - b) / abs(b) for a, b in zip(fp8["losses"], exact["losses"])]
        print(f"rank {rank}: bf16 payload {exact['losses']}, fp8 {fp8['losses']}; relative gap per step "
              f"{[f'{g:.1e}' for g in gaps]}; bytes per forward switch {exact['sent']['forward'][0]} -> "
              f"{fp8['sent']['forward'][0]} (latents {LATENT})")
        assert 0 < max(gaps) < 0.01, gaps     # the payload changed the values, within 1% of the loss


SAVE_AT = 2


def _resume_worker(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    """With the fp8 key: 4 steps uninterrupted; then 2 steps, save, a fresh engine loads and runs steps 3-4."""
    setup_worker(rank, world_size)
    from dsp_plugin.deepspeed import initialize

    def run(steps: range, engine: Any) -> tuple[list[float], list[dict[str, list[int]]]]:
        results = [_train_step(engine, step) for step in steps]
        return [loss for loss, _ in results], [sent for _, sent in results]

    engine, *_ = initialize(model=dsp_model(), config=_fp8_config())
    full, full_sent = run(range(STEPS), engine)
    engine.destroy()

    engine, *_ = initialize(model=dsp_model(), config=_fp8_config())
    before, _ = run(range(SAVE_AT), engine)
    engine.save_checkpoint(save_dir, tag="fp8")
    engine.destroy()

    engine, *_ = initialize(model=dsp_model(), config=_fp8_config())
    load_path, _ = engine.load_checkpoint(save_dir, tag="fp8")
    runtime = repr(engine.module._dsp_plan_runtime.comm_dtype)
    after, after_sent = run(range(SAVE_AT, STEPS), engine)
    engine.destroy()
    return {"full": full, "full_sent": full_sent, "before": before, "after": after, "after_sent": after_sent,
            "runtime": runtime, "load_path": load_path}


@pytest.mark.slow
def test_fp8_key_survives_a_checkpoint_save_and_resume(tmp_path: Path) -> None:
    """The key is read from the config at ``initialize``, not from the checkpoint: an engine resumed from a save
    made with it sends fp8 again, and continues the uninterrupted loss curve."""
    save_dir = str(tmp_path / "ckpt")
    for rank, d in enumerate(run_distributed(_resume_worker, 2, save_dir, timeout=600)):
        full, before, after = d["full"], d["before"], d["after"]
        gaps = [abs(a - b) for a, b in zip(after, full[SAVE_AT:])]
        print(f"rank {rank}: uninterrupted {full}; resumed {before} | save/load | {after}; gap per resumed step "
              f"{gaps}; bytes per forward switch after resume {d['after_sent'][0]['forward']}")
        assert d["load_path"] is not None, "load_checkpoint found no checkpoint"
        assert "float8_e4m3fn" in d["runtime"], d["runtime"]
        assert d["after_sent"] == d["full_sent"][SAVE_AT:], (d["after_sent"], d["full_sent"])
        assert all(s["forward"] and s["backward"] for s in d["after_sent"]), d["after_sent"]
        # Bit-exact (measured, gaps 0.0): make_model seeds torch with 0 each time, the batches are seeded per
        # step, the tiny STDiT draws no random numbers (no dropout), and SGD without momentum keeps no state
        # besides the fp32 master weights, which the ZeRO-2 checkpoint restores with the bf16 module weights.
        assert before == full[:SAVE_AT], (before, full)
        assert after == full[SAVE_AT:], (after, full)
