"""Layer specs, the CPU shim and the megatron-core compatibility hook (in-process, one gloo rank).

The Transformer Engine / FP8 path needs CUDA: those tests carry ``gpu`` and
skip with a reason on CPU. On a GPU machine they build the TE spec at world
size 1, run bf16 and FP8 (TE fp8 autocast) and print the layer throughput.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from dsp_plugin.megatron.cpu import cuda_shim  # noqa: E402
from dsp_plugin.megatron.layers import SDPACoreAttention, dsp_layer_spec, te_available  # noqa: E402

needs_te = pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                              reason="Transformer Engine needs CUDA; this machine has none")


def _config(**overrides: object):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**(base | overrides))


def test_sdpa_core_attention_is_unmasked_softmax_attention() -> None:
    """Megatron's local DotProductAttention cannot run on CPU (score buffer on ``current_device()``,
    dropout under the CUDA RNG tracker); the swapped-in core attention computes the same
    ``softmax(q k^T / sqrt(d)) v`` per (batch, head), with no mask, in Megatron's layouts."""
    config = _config()
    q, k, v = (torch.randn(5, 3, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ours = SDPACoreAttention(config, 1, AttnMaskType.no_mask, "self")(q, k, v, None)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / 8**0.5
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).flatten(2)
    assert ours.shape == (5, 3, 32)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_sdpa_core_attention_refuses_context_parallel_config() -> None:
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        SDPACoreAttention(_config(context_parallel_size=2), 1, AttnMaskType.no_mask, "self")


def test_cuda_shim_maps_cuda_to_cpu_and_restores() -> None:
    with cuda_shim():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")


def test_the_shim_pins_the_cpu_path_where_cuda_is_present(monkeypatch: pytest.MonkeyPatch, one_rank: None) -> None:
    """``make test`` on a GPU machine runs the Megatron tests on the same CPU path as CI: the shim installs
    whether or not CUDA is present (the launch asks ``cuda_is_real()`` before installing it). Simulated: CUDA
    answers as on a GPU machine; a model built where megatron-core builds (``current_device()``) and wrapped
    in Megatron's DDP (grad buffers on ``current_device()``) trains on the CPU."""
    from dsp_plugin.megatron import cpu
    from dsp_plugin.megatron.groups import install_topology
    from dsp_plugin.megatron.model import VideoShape
    from dsp_plugin.megatron.steps import build_model, dsp_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a GPU machine's answer
    assert cpu.cuda_is_real()  # what the launch asks: it would run on the GPU here
    install_topology()
    video = VideoShape(4, 2, 2, 2)
    with cuda_shim():
        assert torch.cuda.current_device() == torch.device("cpu")
        config = dsp_config(video, num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=False, perform_initialization=False)
        ddp = cpu.wrap_ddp(build_model(config, video, text_dim=8, text_len=3), config)
        out = ddp(torch.randn(1, 4, 2, 2, 2), torch.tensor([5]), torch.randn(1, 3, 8))
        out.square().mean().backward()
        assert {b.grad_data.device.type for b in ddp.buffers} == {"cpu"}
    assert torch.cuda.current_device() == 0  # put back


def test_reference_weights_reseed_no_gpu_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle's weights are drawn on a forked CPU generator: no GPU generator is reseeded (that would undo
    Megatron's per-stage seeding) and the CPU generator is put back."""
    from dsp_plugin.megatron.model import VideoShape
    from dsp_plugin.megatron.steps import dsp_config, reference_weights

    reseeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", reseeded.append)
    video = VideoShape(4, 2, 2, 2)
    config = dsp_config(video, num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True)
    state = torch.get_rng_state()
    first, again = (reference_weights(config, video, 8, seed=7) for _ in range(2))
    assert reseeded == [] and torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.skipif(te_available(), reason="checks the message when Transformer Engine is missing")
def test_te_spec_without_te_says_why() -> None:
    with pytest.raises(RuntimeError, match="transformer_engine is not importable"):
        dsp_layer_spec("transformer_engine")


def test_unknown_transformer_impl_is_named() -> None:
    with pytest.raises(ValueError, match="transformer_impl='apex'; expected 'local' or 'transformer_engine'"):
        dsp_layer_spec("apex")


def test_prebuilt_dataset_helpers_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core 0.19.2's wheel ships helpers_cpp but no Makefile, so initialize_megatron's
    compile step exits the job; the hook skips ``make`` when the prebuilt extension imports."""
    from megatron.core.datasets import utils

    from dsp_plugin.megatron.compat import use_prebuilt_dataset_helpers

    datasets_dir = os.path.dirname(utils.__file__)
    assert importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    assert not os.path.exists(os.path.join(datasets_dir, "Makefile")), "wheel ships a Makefile: hook obsolete?"
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # restored after the test

    def no_make(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"make was run: {args}")

    monkeypatch.setattr(subprocess, "run", no_make)
    use_prebuilt_dataset_helpers()
    utils.compile_helpers()  # would call make (and fail) without the hook


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_te_dsp_block_bf16_and_fp8(one_rank: None, fp8: str | None) -> None:
    """TE version of the DSP layer in a stock TransformerBlock at world size 1 (FP8 contexts are the
    block's own): forward/backward run, finite, and the throughput is printed."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from dsp_plugin.megatron.config import FRAME_DIM, DSPTransformerConfig
    from dsp_plugin.megatron.dsp_layer import attach_video_grid

    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89 or newer")
    config = DSPTransformerConfig(num_layers=2, hidden_size=1024, num_attention_heads=16, bf16=True,
                                  params_dtype=torch.bfloat16, fp8=fp8, hidden_dropout=0.0, attention_dropout=0.0)
    block = TransformerBlock(config, dsp_layer_spec("transformer_engine"), post_layer_norm=False).cuda()
    x = torch.randn(16 * 64, 4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attach_video_grid(x, (16, 64), FRAME_DIM)  # 16 frames x 64 patches, whole (one rank)
    cond = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(16, 4, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        block(hidden_states=x, attention_mask=cond, context=text).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    start, iters = time.time(), 10
    for _ in range(iters):
        out = block(hidden_states=x, attention_mask=cond, context=text)
        out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    tokens_per_s = iters * x.shape[0] * x.shape[1] / (time.time() - start)
    print(f"\nTE DSP block {fp8 or 'bf16'}: {tokens_per_s:,.0f} tokens/s (fwd+bwd, 2 layers, hidden 1024)")
    assert torch.isfinite(out.float()).all() and torch.isfinite(x.grad.float()).all()


def test_te_core_attention_of_a_full_layer_is_built_for_the_rank_s_heads() -> None:
    """Transformer Engine's core attention has a fixed head count; in a full layer each DSP rank holds its share
    of the heads after the switch (GQA: the K/V heads its query heads read). Too few heads is refused alike on
    every rank. The local spec (CPU) keeps torch SDPA behind the head switch."""
    from dsp_plugin.megatron.config import DSPTransformerConfig
    from dsp_plugin.megatron.full_attention import head_share_config

    config = DSPTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                                  tensor_model_parallel_size=2, dsp_attend_pattern=("spatial", "full"))
    shares = [head_share_config(config, 2, rank) for rank in (0, 1)]
    # 4 heads and 1 K/V group per TP rank -> 2 query heads and that 1 K/V head on each of 2 DSP ranks
    assert [(c.num_attention_heads, c.num_query_groups) for c in shares] == [(4, 2), (4, 2)]
    assert (config.num_attention_heads, config.num_query_groups) == (8, 2)  # the model's config is untouched
    uneven = [head_share_config(config, 3, rank) for rank in range(3)]  # 4 heads over 3: 2, 1, 1
    assert [(c.num_attention_heads // 2, c.num_query_groups // 2) for c in uneven] == [(2, 1), (1, 1), (1, 1)]
    for rank in range(8):
        with pytest.raises(ValueError, match="4 heads per TP rank .* over dsp size 8 leave ranks without one"):
            head_share_config(config, 8, rank)
    layer_spec = dsp_layer_spec("local").submodules.self_attention.submodules.core_attention
    assert layer_spec is SDPACoreAttention  # full layers wrap it in the head switch; no TE on the CPU path


@pytest.mark.gpu
@needs_te
def test_te_core_attention_behind_the_head_switch_equals_sdpa(one_rank: None) -> None:
    """GPU: ``HeadSwitchCoreAttention`` over Transformer Engine's core attention (GQA, bf16, one rank) equals
    torch SDPA on the same q, k, v; a block with a full layer from the TE spec runs forward and backward."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.transformer_block import TransformerBlock

    from dsp_plugin.megatron.config import FRAME_DIM, DSPTransformerConfig
    from dsp_plugin.megatron.dsp_layer import attach_video_grid
    from dsp_plugin.megatron.full_attention import HeadSwitchCoreAttention, grid_carrier

    config = DSPTransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                                  bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                                  dsp_attend_pattern=("spatial", "full"))
    pg = SimpleNamespace(cp=dist.group.WORLD, tp=dist.group.WORLD)
    ours = HeadSwitchCoreAttention(config, 2, AttnMaskType.no_mask, "self", pg_collection=pg,
                                   local_attention=TEDotProductAttention)
    reference = SDPACoreAttention(config, 2, AttnMaskType.no_mask, "self")
    q, k, v = (torch.randn(8 * 16, 2, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    out = ours(q, k, v, grid_carrier((8, 16), FRAME_DIM))
    torch.testing.assert_close(out, reference(q, k, v, None), rtol=2e-2, atol=2e-2)
    block = TransformerBlock(config, dsp_layer_spec("transformer_engine"), post_layer_norm=False).cuda()
    x = attach_video_grid(torch.randn(8 * 16, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                          (8, 16), FRAME_DIM)
    cond, text = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((2, 256), (4, 2, 256)))
    block(hidden_states=x, attention_mask=cond, context=text).float().square().mean().backward()
    assert torch.isfinite(x.grad.float()).all()


def test_every_layer_kind_hands_linear_qkv_a_contiguous_fold(one_rank: None) -> None:
    """The spatial, temporal and full folds are strided views of the layer's activation; the layer norms them in
    place, so ``linear_qkv`` (Transformer Engine copies a strided input) gets a contiguous tensor (batch 2: with
    one sample some folds are contiguous by accident)."""
    from dsp_plugin.megatron.groups import install_topology
    from dsp_plugin.megatron.model import VideoShape
    from dsp_plugin.megatron.steps import build_model, dsp_config

    install_topology()
    video = VideoShape(4, 3, 2, 2)
    config = dsp_config(video, num_layers=3, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                        attention_dropout=0.0, use_cpu_initialization=True,
                        dsp_attend_pattern=("spatial", "temporal", "full"))
    model = build_model(config, video, text_dim=8, text_len=3)
    seen: list[tuple[int, bool]] = []
    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.register_forward_pre_hook(
            lambda module, args, number=layer.layer_number: seen.append((number, args[0].is_contiguous())))
    with cuda_shim():
        model(torch.randn(2, 4, 3, 2, 2), torch.tensor([5, 9]), torch.randn(2, 3, 8))
    assert seen == [(1, True), (2, True), (3, True)], seen
