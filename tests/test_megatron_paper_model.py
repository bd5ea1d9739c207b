"""OpenSora 1.2's model (STDiT3) through Megatron's own flags, against the plain-torch reference.

Features (``tests/megatron_compositions.tiny_config(variant="paper")``): ``--position-embedding-type
rope`` (temporal, and 2-D in spatial layers with ``--spatial-rope``), ``--qk-layernorm`` (torch norms,
no Transformer Engine), captions of varying length (a key-padding mask in cross-attention) and
adaLN-single. The oracle is ``dsp_plugin.models.stdit.STDiT`` with the same features, sharing no code
with the Megatron layers. ``paper+buckets`` also changes (frames, height, width) every step: the
global lengths travel with the batch and the hidden states' ShardSpec, never the config.

Compared per layout, fp32, relative to the oracle: outputs, parameter gradients (DDP's reduced
``main_grad``) and the losses of 3 SGD steps. Run with ``-s`` for the table.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import (  # noqa: E402
    BUCKETS,
    PAPER_FOUR_RANK,
    PAPER_TWO_RANK,
    SEED,
    TEXT_DIM,
    TEXT_LEN,
    VIDEO,
    max_relative_differences,
    parse_error,
    reference_run,
    run_layouts,
    tiny_config,
)

STEPS = 3
TOLERANCE = 1e-5  # relative, fp32
VARIANT = "paper+buckets"
LAYOUTS = {**PAPER_TWO_RANK, **PAPER_FOUR_RANK}
PAPER_FLAGS = ["--position-embedding-type", "rope", "--qk-layernorm", "--no-rope-fusion", "--spatial-rope",
               "--adaln-single", "--varying-captions", "--video-buckets", "6,2,3;4,3,2"]


def _oracle_pair(variant: str = "paper") -> tuple:
    from dsp_plugin.megatron.steps import build_model, reference_weights
    from dsp_plugin.megatron.weights import reference_config
    from dsp_plugin.models.stdit import STDiT

    config = tiny_config(1, 1, variant=variant)
    model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN, seed=SEED)
    reference = STDiT(reference_config(config, VIDEO.channels, TEXT_DIM))
    reference.load_state_dict(reference_weights(config, VIDEO, TEXT_DIM, SEED))
    return config, model, reference


@pytest.mark.parametrize("geometry", [BUCKETS[0], BUCKETS[2]])
def test_one_rank_megatron_model_equals_the_reference(one_rank: None, geometry: tuple[int, int, int]) -> None:
    """TP = PP = DSP = 1, two geometries through one model: outputs and every parameter's gradient."""
    from dsp_plugin.megatron.weights import megatron_names

    config, model, reference = _oracle_pair()
    frames, height, width = geometry
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, VIDEO.channels, frames, height, width, generator=gen)
    timestep, text = torch.tensor([3, 700]), torch.randn(2, TEXT_LEN, TEXT_DIM, generator=gen)
    text_mask = torch.tensor([[True, False, False], [True, True, True]])
    ours = model(latents, timestep, text, text_mask)                                  # [B, T, S, C]
    theirs = reference(latents, timestep, text, text_mask).permute(0, 2, 3, 4, 1).reshape(ours.shape)
    weight = torch.randn(ours.shape, generator=gen)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    expected = megatron_names({n: p.grad for n, p in reference.named_parameters()}, config.num_attention_heads)
    assert set(expected) == {n for n, _ in model.named_parameters()}
    assert {"t_block.1.weight", "final_scale_shift_table", "decoder.layers.0.scale_shift_table",
            "decoder.layers.1.self_attention.q_layernorm.weight"} <= set(expected)
    for name, p in model.named_parameters():  # relative to the tensor's scale, as the layouts below
        scale = expected[name].abs().max()
        assert scale > 0, f"{name} is not exercised"
        assert (p.grad - expected[name]).abs().max() / scale < TOLERANCE, name
    # the mask is real: the padding's values do not matter, the mask does
    padded = text.masked_fill(~text_mask[..., None], 5.0)
    with torch.no_grad():
        torch.testing.assert_close(model(latents, timestep, padded, text_mask), ours, rtol=1e-5, atol=1e-6)
        assert (model(latents, timestep, text, None) - ours).abs().max() > 1e-3


def test_adaln_single_tables_are_in_the_sharded_checkpoint(one_rank: None) -> None:
    """The new parameters (tables, t_block, q/k norms) are in Megatron's sharded state dict, replicated."""
    _, model, _ = _oracle_pair()
    keys = set(model.sharded_state_dict())
    assert {"final_scale_shift_table", "decoder.layers.0.scale_shift_table", "t_block.1.weight",
            "decoder.layers.3.self_attention.k_layernorm.weight"} <= keys, sorted(keys)


def test_untagged_hidden_states_are_refused(one_rank: None) -> None:
    """The layers take (T, S) from the hidden states' ShardSpec only; a bare tensor gets a clear error."""
    config, model, _ = _oracle_pair()
    hidden = torch.randn(VIDEO.tokens, 1, config.hidden_size)
    with pytest.raises(ValueError, match="carry no video shard tag"):
        model.decoder(hidden_states=hidden, attention_mask=torch.randn(1, 6 * config.hidden_size))


def test_none_mode_parses_the_paper_flags() -> None:
    """``MODE=none NPROC=1`` accepts the same flags; fused RoPE without TE is refused while parsing."""
    base = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "36",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3", "--lr", "0.1"]
    assert parse_error([*base, *PAPER_FLAGS, "--sequence-parallel-mode", "none"], 1, launch=True) == ""
    assert parse_error([*base, *PAPER_FLAGS, "--sequence-parallel-mode", "dsp", "--dsp-size", "2"], 2,
                       launch=True) == ""
    fused = [f for f in PAPER_FLAGS if f != "--no-rope-fusion"]
    assert "pass --no-rope-fusion" in parse_error([*base, *fused], 1, launch=True)
    assert "take one of" in parse_error([*base, "--position-embedding-type", "mrope",
                                         "--mrope-section", "1", "1"], 1, launch=True)


def _reference_under_the_plan(rank: int, world_size: int) -> dict[str, float]:
    """The reference with every feature, DSP applied from outside (``dsp_plugin.parallelize``) vs one process."""
    import copy

    from dsp_plugin import parallelize, reduce_gradients
    from dsp_plugin.models import STDiT, STDiTConfig

    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny", temporal_rope=True, spatial_rope=True, qk_norm="RMSNorm",
                                         adaln_single=True))
    model = parallelize(copy.deepcopy(reference))
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 5, 6, 4, generator=gen)  # T = 5, S = 3 x 2: uneven over 2 ranks
    text, text_mask = torch.randn(2, 3, 16, generator=gen), torch.tensor([[1, 0, 0], [1, 1, 1]]).bool()
    outs = []
    for net in (reference, model):
        out = net(latents, torch.tensor([5, 600]), text, text_mask)
        out.square().mean().backward()
        outs.append(out.detach())
    reduce_gradients(model.parameters())
    grads = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    return {"outputs": ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item(), "grads": grads}


def test_reference_features_are_shard_safe_under_the_plan() -> None:
    """The oracle's own features hold under DSP=2 applied by the plan: the attended dim is whole on every
    rank, so RoPE positions are global; the caption mask and adaLN-single are per sample."""
    for diffs in run_distributed(_reference_under_the_plan, 2, timeout=120):
        assert max(diffs.values()) < TOLERANCE, diffs


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run(STEPS, VARIANT)


@pytest.fixture(scope="module")
def layouts() -> dict[str, list[dict]]:
    """Every layout, two spawns (importing megatron dominates the cost)."""
    out = {}
    for world, group in ((2, PAPER_TWO_RANK), (4, PAPER_FOUR_RANK)):
        names = list(group)
        per_rank = run_distributed(run_layouts, world, [group[n] for n in names], STEPS, None, VARIANT,
                                   timeout=420)
        out |= {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(names)}
    return out


def test_oracle_sees_every_bucket(reference: dict) -> None:
    """Each step is another (frames, patches) bucket, and the oracle moves: equality below means something."""
    shapes = [tuple(o.shape[1:3]) for o in reference["outputs"]]
    assert shapes == [(t, h * w) for t, h, w in BUCKETS][:STEPS], shapes
    assert len(set(reference["losses"])) == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_reference(name: str, reference: dict, layouts: dict) -> None:
    diffs = max_relative_differences(reference, layouts[name], LAYOUTS[name][3])
    print(f"\n{VARIANT} {name}: max relative diff outputs {diffs['outputs']:.1e}, grads {diffs['grads']:.1e}, "
          f"losses {diffs['losses']:.1e}")
    assert max(diffs.values()) < TOLERANCE, (name, diffs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DSP=2", "PP=2 x DSP=2"])
def test_full_recompute_replays_no_switch(name: str, layouts: dict) -> None:
    """With every feature and changing buckets, full recompute issues exactly the all-to-alls of the plain
    run: each chunk's first layer reuses its switch and keeps its tagged input for the recompute."""
    def counts(result: dict) -> tuple[int, int]:
        return tuple(sum(1 for op, size, ph in result["collectives"] if op == "all_to_all" and size == 2
                         and ph == phase) for phase in ("forward", "backward"))

    for plain, recompute in zip(layouts[name], layouts[f"{name} + full recompute"], strict=True):
        switched = plain["stage_layers"] - (1 if plain["first_stage"] else 0)
        expected = switched * LAYOUTS[name][4]  # one per switching layer and micro-batch
        assert counts(plain) == counts(recompute) == (expected, expected), (counts(plain), counts(recompute))


#: ``MODE=none NPROC=1 DSP=1 ./launch/run_megatron.sh $LAUNCH_FLAGS`` (single process, Megatron Adam), measured
SINGLE_PROCESS = {1: 1.196529746, 2: 1.239910722, 3: 0.9898111820}
LAUNCH_FLAGS = ["--position-embedding-type", "rope", "--qk-layernorm", "--no-rope-fusion", "--spatial-rope",
                "--adaln-single", "--varying-captions", "--video-buckets", "8,2,3;5,3,2;6,2,2", "--init-seed", "7"]


@pytest.mark.slow
def test_dsp2_launch_with_the_paper_flags_logs_the_single_process_losses(tmp_path) -> None:
    """The real launch (megatron.training's pretrain(): parsing, Megatron's optimizer, samplers, schedules)
    with every feature and three buckets, one per iteration: DSP=2's loss scalars are the single-process
    losses. (TensorBoard holds each iteration's own loss; the log line averages iterations 1 and 2.)"""
    pytest.importorskip("megatron.training")
    pytest.importorskip("tensorboard")
    from tests.megatron_launch import launch, tensorboard_losses

    logged, _ = launch(*LAUNCH_FLAGS, "--tensorboard-dir", str(tmp_path), NPROC="2", DSP="2")
    losses = tensorboard_losses(tmp_path)
    print(f"\npaper-flag launch losses: DSP=2 {losses} (log lines {logged}), single process (measured) "
          f"{SINGLE_PROCESS}")
    assert sorted(losses) == [1, 2, 3]
    assert max(abs(SINGLE_PROCESS[i] - losses[i]) for i in losses) < 1e-5, losses
