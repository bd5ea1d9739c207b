"""Issue 16's DeepSpeed cases on two real ranks: a rank-owned token under ZeRO 1-3, a model DSP-aware
on one rank only, a rank-local permutation of the input, and checkpoints mixed from two saves.

Each spawn runs its cases in turn on the same two processes and is bounded by
``run_distributed``'s timeout, so a rank that hung fails the test instead of
blocking the suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.deepspeed_harness import ds_config, dsp_model, global_batch, loss_fn, make_model, setup_worker
from tests.distributed import run_distributed
from tests.test_reliability import OwnedToken

SGD = {"type": "SGD", "params": {"lr": 0.5}}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)


def _owned_token_zero(rank: int, world_size: int) -> dict[int, dict[str, np.ndarray]]:
    setup_worker(rank, world_size)
    from deepspeed.utils import safe_get_full_fp32_param

    from dsp_plugin.deepspeed import initialize

    out = {}
    x, target = _batch()
    for stage in (1, 2, 3):
        engine, *_ = initialize(model=OwnedToken(dsp=True), config=ds_config(stage, 2, micro_batch=2, optimizer=SGD))
        engine.backward(torch.nn.functional.mse_loss(engine(x), target))
        engine.step()
        out[stage] = {n: safe_get_full_fp32_param(p).detach().clone().numpy() for n, p in engine.module.named_parameters()}
        engine.destroy()
    return out


@pytest.mark.slow
def test_rank_owned_token_trains_like_one_process_under_zero_1_2_3() -> None:
    results = run_distributed(_owned_token_zero, 2, timeout=400)
    reference = OwnedToken(dsp=False)
    x, target = _batch()
    torch.nn.functional.mse_loss(reference(x), target).backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    for rank, by_stage in enumerate(results):
        for stage, params in by_stage.items():
            for name, p in reference.named_parameters():
                diff = float(np.abs(params[name] - p.detach().numpy()).max())
                assert diff < 1e-5, f"rank {rank}, ZeRO-{stage}: {name} differs from one process by {diff:.3g}"


def _guard_cases(rank: int, world_size: int) -> dict[str, str]:
    setup_worker(rank, world_size)
    from dsp_plugin.checks import InputMismatch
    from dsp_plugin.deepspeed import DSPGuardError, initialize

    out = {}
    # DSP-aware on rank 0 only: rank 0 waits in split's first-call check while rank 1's forward ends
    engine, *_ = initialize(model=dsp_model() if rank == 0 else make_model(),
                            config=ds_config(2, 2, micro_batch=1, optimizer=SGD))
    try:
        loss_fn(engine, global_batch(0, 1))
        out["some_ranks"] = "no error"
    except (DSPGuardError, ValueError) as exc:
        out["some_ranks"] = f"{type(exc).__name__}: {exc}"
    engine.destroy()
    # a rank-local permutation: same count, sum and sum of squares as its peer's input
    engine, *_ = initialize(model=dsp_model(), config=ds_config(2, 2, micro_batch=1, optimizer=SGD))
    latents, timestep, text, target = global_batch(0, 1)
    if rank == 1:
        latents = latents.flip(2)
    try:
        loss_fn(engine, (latents, timestep, text, target))
        out["permuted"] = "no error"
    except (DSPGuardError, InputMismatch) as exc:  # the parallelized model's entry check fires first now
        out["permuted"] = str(exc)
    engine.destroy()
    return out


@pytest.mark.slow
def test_guard_sharded_on_some_ranks_and_permuted_inputs() -> None:
    results = run_distributed(_guard_cases, 2, collective_timeout_s=30, timeout=300)
    print("\n".join(f"rank {r}: {out['some_ranks']}" for r, out in enumerate(results)))
    assert "rank 1 finished the first forward without a DSP primitive and is in the DeepSpeed guard" \
        in results[0]["some_ranks"], results[0]
    assert "the model is DSP-aware on some ranks only: rank(s) [0] of DSP group [0, 1] are inside a DSP primitive" \
        in results[1]["some_ranks"], results[1]
    for out in results:
        assert ("the first forward's inputs differ inside DSP group(s) [[0, 1]]" in out["permuted"]
                or "the inputs differ across the 2 ranks of group [0, 1]: latents" in out["permuted"]), out


def _save_twice(rank: int, world_size: int, root: str) -> dict[str, Any]:
    setup_worker(rank, world_size)
    from dsp_plugin.deepspeed import checkpoint, initialize

    # AdamW as in the launch config: ds_to_universal reads Adam's moments
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    engine, *_ = initialize(model=dsp_model(), config=ds_config(2, 2, micro_batch=1, optimizer=adamw))
    tags = []
    for step in (1, 2):
        engine.backward(loss_fn(engine, global_batch(step, 1)))
        engine.step()
        tags.append(checkpoint.save(engine, root, step=step, client_state={"marker": step}))
    saved = {n: p.detach().clone().numpy() for n, p in engine.module.named_parameters()}
    engine.backward(loss_fn(engine, global_batch(3, 1)))
    engine.step()
    client = checkpoint.load(engine, root)
    loaded = {n: p.detach().clone().numpy() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"tags": tags, "marker": client["marker"],
            "diff": max(float(np.abs(saved[n] - loaded[n]).max()) for n in saved)}


@pytest.mark.slow
def test_checkpoints_one_tag_per_save_and_a_mix_is_refused(tmp_path: Path) -> None:
    from dsp_plugin.deepspeed.checkpoint import CheckpointError, check_load_dir

    root = tmp_path / "ckpt"
    results = run_distributed(_save_twice, 2, str(root), timeout=300)
    first, second = results[0]["tags"]
    assert first != second and results[1]["tags"] == [first, second], results
    assert (root / "latest").read_text() == second
    for out in results:
        assert out["marker"] == 2 and out["diff"] == 0.0, out
    assert check_load_dir(root)[0] == second
    # ds_to_universal converts the launch's checkpoints without --inject_missing_state
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / second), "--output_folder", str(tmp_path / "universal")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # rank 1's optimizer partition from the older save, as an interrupted or hand-mended save leaves it
    partition = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(root / first / partition, root / second / partition)
    with pytest.raises(CheckpointError, match=f"holds files that are not from save .*changed \\['{partition}'\\]"):
        check_load_dir(root)
    # manifests of two saves
    manifest = json.loads((root / first / "dsp_manifest_rank1.json").read_text())
    (root / second / "dsp_manifest_rank1.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="mixes saves"):
        check_load_dir(root)


def test_checkpoint_directories_that_cannot_load_or_save(tmp_path: Path) -> None:
    from dsp_plugin.deepspeed.checkpoint import CheckpointError, check_load_dir, check_save_dir

    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        check_load_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no 'latest' file"):
        check_load_dir(tmp_path / "empty")
    (tmp_path / "empty" / "step1").mkdir()
    (tmp_path / "empty" / "latest").write_text("step1")
    with pytest.raises(CheckpointError, match="has no model states"):
        check_load_dir(tmp_path / "empty")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot be written"):
        check_save_dir(tmp_path / "file" / "ckpt")
    assert check_save_dir(tmp_path / "new" / "deeper").is_dir()     # a missing parent is created
