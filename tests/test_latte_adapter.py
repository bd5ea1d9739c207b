"""The Latte adapter equals diffusers' unmodified LatteTransformer3DModel (forward and backward).

Oracle: the diffusers model itself on one process (its own forward, which shares
no code with the adapter's sharded forward), on the same weights and batch.
Uneven frame counts: 7 frames on 2 ranks (4+3) and 4 ranks (2+2+2+1), and n + 1 frames on n ranks,
where the last rank holds a single frame (2+1 on 2 ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.adapters.latte import LatteDSP  # noqa: E402
from dsp_plugin.checks import check_mode  # noqa: E402
from dsp_plugin.testing.tiny import tiny_latte  # noqa: E402
from tests.distributed import assert_no_steady_state_checks, run_distributed  # noqa: E402

LAYERS = 2


def _batch(frames: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 4, frames, 8, 8, generator=g)
    timestep = torch.randint(0, 1000, (2,), generator=g)
    text = torch.randn(2, 5, 16, generator=g)
    target = torch.randn(2, 8, frames, 8, 8, generator=g)
    return latents, timestep, text, target


def _run(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    latents, timestep, text, target = batch
    latents = latents.clone().requires_grad_(True)
    out = model(latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    grads = {k.removeprefix("model."): p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), latents.grad, grads


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_single_process_equals_unmodified_model() -> None:
    reference = tiny_latte(layers=LAYERS)
    batch = _batch()
    out_ref, dx_ref, g_ref = _run(reference, batch)
    out, dx, g = _run(LatteDSP(copy.deepcopy(reference)), batch)
    assert (out - out_ref).abs().max() < 1e-5
    assert (dx - dx_ref).abs().max() < 1e-5
    assert _max_diff(g, g_ref) < 1e-5
    assert len(g) == len(list(reference.parameters()))


def _parallel(rank: int, n: int) -> dict[str, float | str]:
    reference = tiny_latte(layers=LAYERS)
    batch = _batch()
    out_ref, dx_ref, g_ref = _run(reference, batch)
    result: dict[str, float | str] = {}
    for checkpointing in (False, True):
        model = copy.deepcopy(reference)
        if checkpointing:
            model.enable_gradient_checkpointing()
        adapter = LatteDSP(model)
        with CommAccounting(activations=False) as acct:
            out, dx, _ = _run(adapter, batch)
        reduce_gradients(adapter.parameters())
        g = {k.removeprefix("model."): p.grad for k, p in adapter.named_parameters()}
        tag = "ckpt_" if checkpointing else ""
        result |= {f"{tag}out": (out - out_ref).abs().max().item(), f"{tag}dx": (dx - dx_ref).abs().max().item(),
                   f"{tag}grads": _max_diff(g, g_ref)}
        if not checkpointing:
            with CommAccounting(activations=False) as steady:      # the same step again: nothing is new
                _run(adapter, batch)
            result |= {"fwd_all_to_all": acct.count("all_to_all", "forward"),
                       "fwd_all_gather": acct.count("all_gather", "forward"),
                       "steady_checks": [(r.op, r.group_ranks) for r in steady.check_records],
                       "check_mode": check_mode()}
    # n + 1 frames: the last rank holds a single frame (2+1 on 2 ranks), where a local frame count
    # used in place of the global one shows even on 2 ranks
    few = _batch(frames=n + 1)
    reference = tiny_latte(frames=n + 1, layers=LAYERS)
    adapter = LatteDSP(copy.deepcopy(reference))
    out_ref, dx_ref, g_ref = _run(reference, few)
    out, dx, _ = _run(adapter, few)
    reduce_gradients(adapter.parameters())
    g = {k.removeprefix("model."): p.grad for k, p in adapter.named_parameters()}
    result |= {"single_out": (out - out_ref).abs().max().item(), "single_dx": (dx - dx_ref).abs().max().item(),
               "single_grads": _max_diff(g, g_ref)}
    # bad input is caught before any collective, on every rank, so the group stays usable
    try:
        LatteDSP(tiny_latte(frames=n - 1, layers=1))(*_batch(frames=n - 1)[:1], timestep=batch[1],
                                                     encoder_hidden_states=batch[2])
    except ValueError as exc:
        result["too_few_frames"] = str(exc)
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_equals_unmodified_model_uneven_frames(n: int) -> None:
    """7 frames on 2 and 4 ranks, with and without the model's own gradient checkpointing; n + 1 frames;
    no fingerprint exchange once every signature is known."""
    for rank, d in enumerate(run_distributed(_parallel, n)):
        print(f"n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items() if isinstance(v, float)))
        for prefix, frames, how in (("", 7, ""), ("ckpt_", 7, " under gradient checkpointing"),
                                    ("single_", n + 1, " (the last rank holds a single frame: a local frame "
                                                       "count used in place of the global one?)")):
            sizes = [len(c) for c in torch.arange(frames).tensor_split(n)]
            for key, what in (("out", "output"), ("dx", "input gradient"), ("grads", "parameter gradients")):
                diff = d[prefix + key]
                assert diff < 1e-5, f"rank {rank}/{n}, {frames} frames split {sizes}{how}: the adapter's " \
                    f"{what} differs from the unmodified model's by {diff:.3g}"
        # two switches per layer (the last one back to frames for the output stage); one exit gather
        assert d["fwd_all_to_all"] == 2 * LAYERS, d
        assert d["fwd_all_gather"] == 1, d
        assert_no_steady_state_checks(d["steady_checks"], d["check_mode"], f"LatteDSP, rank {rank}/{n}")
        assert f"frames={n - 1} is smaller than the DSP size {n}" in d.get("too_few_frames", ""), d


def test_rejects_other_models() -> None:
    with pytest.raises(TypeError, match="expected a diffusers LatteTransformer3DModel, got Linear"):
        LatteDSP(torch.nn.Linear(2, 2))


def _shard_frames(rank: int, n: int) -> dict[str, object]:
    """fp64, 5 frames on 4 ranks (split [2, 1, 1, 1]): three ranks are fed ONE frame of a 5-frame video."""
    import torch.distributed as dist

    import dsp_plugin
    from dsp_plugin.plan.builtin import LATTE_PLAN
    from dsp_plugin.plan.runtime import apply_plan

    reference = tiny_latte(frames=5, layers=LAYERS, heads=3, head_dim=4, sample_size=6).double()
    g = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 5, 6, 6, generator=g, dtype=torch.float64)
    timestep, text = torch.tensor([3, 700]), torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    frames = torch.arange(5).tensor_split(n)[rank]
    local = latents[:, :, frames]
    result: dict[str, object] = {"local_frames": len(frames)}
    with torch.no_grad():
        expected = reference(latents, timestep, text, return_dict=False)[0][:, :, frames]
        model = dsp_plugin.parallelize(copy.deepcopy(reference))     # the model's own parallelize first
        hooks = len(model._dsp_plan_runtime.handles)
        adapter = LatteDSP(model)                                    # reuses it: not applied twice
        result["hooks_reused"] = len(model._dsp_plan_runtime.handles) == hooks and adapter.model is model
        for temporal in (True, False):
            out = adapter.forward_shard(local, num_frames=5, timestep=timestep, encoder_hidden_states=text,
                                        enable_temporal_attentions=temporal)
            want = expected if temporal else reference(latents, timestep, text, enable_temporal_attentions=False,
                                                       return_dict=False)[0][:, :, frames]
            result[f"temporal{int(temporal)}"] = (out - want).abs().max().item()
        # without OnShard the ranks fed one frame skip Latte's temporal positions: the correction is needed
        bare = apply_plan(copy.deepcopy(reference), {k: v for k, v in LATTE_PLAN.items()
                                                     if k != "temporal_transformer_blocks.0"})
        with dsp_plugin.plan.sharded_io(T=5):
            out = bare(local, timestep, text, return_dict=False)[0]
        result["without_onshard"] = (out - expected).abs().max().item()
        # a later adapter over another group takes the hooks; the earlier one refuses to run
        LatteDSP(model, group=dist.new_group(list(range(n))))
        try:
            adapter.forward_shard(local, num_frames=5, timestep=timestep, encoder_hidden_states=text)
        except RuntimeError as exc:
            result["stale"] = str(exc)
    return result


def test_forward_shard_ranks_fed_one_frame() -> None:
    """5 frames on 4 ranks in fp64: ``forward_shard`` equals the unmodified model's frames of each rank within
    1e-9, with temporal attention on and off; Latte's ``if num_frame > 1`` (local on a shard) is corrected by the
    plan's OnShard (without it the one-frame ranks differ); LatteDSP reuses the model's own parallelize."""
    for rank, d in enumerate(run_distributed(_shard_frames, 4)):
        print(f"rank {rank}: {d}")
        assert d["local_frames"] == [2, 1, 1, 1][rank]
        assert d["temporal1"] < 1e-9 and d["temporal0"] < 1e-9, (rank, d)
        assert d["hooks_reused"], d
        if d["local_frames"] == 1:
            assert d["without_onshard"] > 1e-3, (rank, d)
        assert "parallelized again" in d.get("stale", ""), d
