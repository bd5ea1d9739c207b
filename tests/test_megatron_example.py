"""The independent oracle at size 1, and the documented own-model example on 2 ranks.

- ``STDiTMegatron`` at TP = PP = DSP = 1, with the weights of the plain-torch
  ``STDiT`` (``dsp_plugin/models/stdit.py``), gives its outputs and gradients (fp32, 1e-5).
- The "Your own model" block of docs/megatron.md, executed from the file, gives the
  same output and input gradient at DSP=2 as at DSP=1, and a rotary table is refused by a layer whose
  config does not ask for RoPE.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import SEED, TEXT_DIM, TEXT_LEN, VIDEO, tiny_config  # noqa: E402
from tests.megatron_example import example_and_dropout  # noqa: E402


def test_oracle_megatron_model_equals_plain_torch_stdit(one_rank: None) -> None:
    from dsp_plugin.megatron.steps import build_model, reference_weights
    from dsp_plugin.megatron.tokens import require_dsp_layers
    from dsp_plugin.megatron.weights import megatron_names, reference_config
    from dsp_plugin.models.stdit import STDiT

    config = tiny_config(1, 1)
    model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN, seed=SEED)
    require_dsp_layers(model)
    reference = STDiT(reference_config(config, VIDEO.channels, TEXT_DIM))
    reference.load_state_dict(reference_weights(config, VIDEO, TEXT_DIM, SEED))
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, VIDEO.channels, VIDEO.frames, VIDEO.height, VIDEO.width, generator=gen)
    timestep, text = torch.tensor([3, 700]), torch.randn(2, TEXT_LEN, TEXT_DIM, generator=gen)
    ours = model(latents, timestep, text)                                      # [B, T, S, C]
    theirs = reference(latents, timestep, text).permute(0, 2, 3, 4, 1).reshape(ours.shape)
    weight = torch.randn(ours.shape, generator=gen)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    expected = megatron_names({n: p.grad for n, p in reference.named_parameters()}, config.num_attention_heads)
    assert set(expected) == {n for n, _ in model.named_parameters()}
    worst = max((p.grad - expected[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"\noracle TP=PP=DSP=1: max |output diff| = {(ours - theirs).abs().max().item():.1e}, "
          f"max |grad diff| = {worst:.1e}")
    assert worst < 1e-5
    assert all(p.grad.abs().max() > 0 for p in model.parameters())  # every parameter is exercised


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """The documented example at DSP=2 and DSP=1, and the dropout case, on 2 ranks (one spawn)."""
    return run_distributed(example_and_dropout, 2, [2, 1], timeout=300)


def test_documented_own_model_example_dsp2_equals_dsp1(two_ranks: list) -> None:
    dsp2, dsp1 = two_ranks[0][0]
    diff = np.abs(dsp2["out"] - dsp1["out"]).max()
    grad = np.abs(dsp2["video_grad"] - dsp1["video_grad"]).max()
    print(f"\ndocs example: DSP=2 vs DSP=1 max |output diff| = {diff:.1e}, max |input grad diff| = {grad:.1e}")
    assert np.abs(dsp1["out"]).max() > 0.1
    # the entry split and 3 switches (layers 2-4); none at DSP=1 (DP=2)
    assert dsp1["sharded_calls"] == 0 and dsp2["sharded_calls"] == 4, (dsp1["sharded_calls"], dsp2["sharded_calls"])
    assert diff < 1e-5 and grad < 1e-5
    assert "got rotary_pos_emb but position_embedding_type='learned_absolute'" in dsp2["rope_error"]


def test_dropout_masks_differ_between_shards_and_survive_recompute(two_ranks: list) -> None:
    """Megatron seeds the ranks of a DSP group alike; each shard still draws its own hidden- and attention-dropout
    masks, and full recompute redraws the first run's masks (the same output and gradients as without it)."""
    rank0, rank1 = (result[1] for result in two_ranks)
    for result in (rank0, rank1):
        assert result["dropout_changes_output"] > 1e-3  # dropout is on
        assert result["recompute_output_diff"] == 0.0
        plain, recomputed = result["grads"]
        for name in plain:
            np.testing.assert_allclose(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, err_msg=name)
    dropped = [int((r["mask"] == 0).sum()) for r in (rank0, rank1)]
    print(f"\nhidden dropout 0.5 on 2 x 192 ones: dropped {dropped}, masks equal on "
          f"{int((rank0['mask'] == rank1['mask']).sum())} of {rank0['mask'].size} elements")
    assert 0 < min(dropped) and not np.array_equal(rank0["mask"], rank1["mask"])
    assert not np.allclose(rank0["attention"], rank1["attention"])  # attention dropout: each shard its own mask


def test_adaln_zero_initialisation_in_both_models(one_rank: None) -> None:
    """adaLN-Zero: the reference with ``adaln_zero=True`` outputs zeros at init; the Megatron layer
    zero-initialises its modulation whenever Megatron initialises weights."""
    from dataclasses import replace

    from dsp_plugin.megatron.steps import build_model
    from dsp_plugin.megatron.weights import reference_config
    from dsp_plugin.models.stdit import STDiT

    config = tiny_config(1, 1)
    reference = STDiT(replace(reference_config(config, VIDEO.channels, TEXT_DIM), adaln_zero=True))
    latents = torch.randn(1, VIDEO.channels, VIDEO.frames, VIDEO.height, VIDEO.width)
    assert reference(latents, torch.tensor([5]), torch.randn(1, TEXT_LEN, TEXT_DIM)).abs().max() == 0
    config.perform_initialization = True
    model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN)
    for layer in model.decoder.layers:
        assert layer.adaln_modulation.weight.abs().max() == 0 and layer.adaln_modulation.bias.abs().max() == 0


def test_flops_formula_counts_the_model(one_rank: None) -> None:
    """The throughput log's FLOPs: the formula equals torch's FLOP counter on one forward (matmuls,
    attention), so Megatron's TFLOP/s figure is this model's, not the GPT formula's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from dsp_plugin.megatron.flops import forward_flops_per_sample
    from dsp_plugin.megatron.steps import build_model

    config = tiny_config(1, 1)
    model = build_model(config, VIDEO, text_dim=TEXT_DIM, text_len=TEXT_LEN, seed=SEED)
    latents = torch.randn(2, VIDEO.channels, VIDEO.frames, VIDEO.height, VIDEO.width)
    # the math SDPA backend decomposes into matmuls, which the counter sees (the fused CPU kernel it does not)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(latents, torch.tensor([1, 2]), torch.randn(2, TEXT_LEN, TEXT_DIM))
    expected = 2 * forward_flops_per_sample(
        frames=VIDEO.frames, patches=VIDEO.patches, channels=VIDEO.channels, hidden=config.hidden_size,
        ffn_hidden=config.ffn_hidden_size, num_layers=config.num_layers, text_len=TEXT_LEN, text_dim=TEXT_DIM)
    assert counter.get_total_flops() == expected, (counter.get_total_flops(), expected)
