"""``--sequence-parallel-mode dsp`` through Megatron's real argument parsing and validation.

In-process: ``megatron.training.arguments.parse_args`` with the DSP
``extra_args_provider`` and then Megatron's own ``validate_args``. Every DSP
error is raised while parsing, i.e. before ``init_process_group`` on every rank.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytest.importorskip("megatron.training")

from dsp_plugin.megatron.arguments import add_dsp_arguments, check_fp8_shapes  # noqa: E402

BASE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "48",
        "--max-position-embeddings", "48", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1",
        "--distributed-backend", "gloo"]


def _with_model_arguments(parser):
    from dsp_plugin.megatron.steps import add_model_arguments

    return add_model_arguments(add_dsp_arguments(parser))


def parse(monkeypatch: pytest.MonkeyPatch, argv: list[str], world_size: int, *, validate: bool = True,
          provider=add_dsp_arguments):
    from megatron.training.arguments import parse_args, validate_args

    from dsp_plugin.megatron.cpu import cuda_shim

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_stdit.py", *BASE, *argv])
    args = parse_args(extra_args_provider=provider)
    if validate:
        with cuda_shim():  # validate_args asks for the GPU architecture
            validate_args(args, {})
    return args


def test_dsp_takes_the_context_parallel_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "2",
                               "--tensor-model-parallel-size", "2"], world_size=8)
    assert (args.sequence_parallel_mode, args.dsp_size, args.context_parallel_size) == ("dsp", 2, 2)
    assert args.data_parallel_size == 2  # computed by Megatron: 8 / (tp 2 * cp 2 * pp 1)


def test_default_dsp_size_takes_what_tp_and_pp_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2"], world_size=8)
    assert (args.dsp_size, args.context_parallel_size, args.data_parallel_size) == (2, 2, 1)


def test_mode_none_leaves_megatron_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, ["--context-parallel-size", "2"], world_size=2)
    assert (args.sequence_parallel_mode, args.dsp_size, args.context_parallel_size) == ("none", 1, 2)


def test_megatron_sequence_parallel_keeps_working_without_dsp(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch, ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=4)
    assert args.sequence_parallel is True and args.dsp_size == 1


GEOMETRY = ["--num-frames", "6", "--latent-height", "2", "--latent-width", "3", "--text-len", "4"]


@pytest.mark.parametrize(("argv", "world_size", "message"), [
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--dsp-size", "2"], 4,
     "--sequence-parallel-mode dsp does not support --sequence-parallel"),
    (["--position-embedding-type", "mrope", "--dsp-size", "2"], 2,
     "--position-embedding-type mrope: the spatial-temporal DSP layers take one of"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "--dsp-size", "2"], 2,
     "--recompute-modules ['core_attn', 'mlp'] is not supported"),
    (["--transformer-impl", "transformer_engine", "--dsp-size", "8", "--seq-length", "48"], 8,
     "dsp size (8) exceeds the frames (6) or patches (6) of a sample: some ranks would hold empty shards"),
    (["--fp8-format", "hybrid", "--dsp-size", "4", "--micro-batch-size", "1", "--seq-length", "48"], 4,
     "FP8 (--fp8-recipe delayed) needs every GEMM input and weight with rows divisible by 8 and last dim "
     "divisible by 16 (Transformer Engine's rule) on every DSP rank (dsp size 4): linear_qkv input: spatial "
     "layer tokens (6 patches x 1 local frames x micro batch 1): 6 rows x 16"),
    (["--fp8-format", "hybrid", "--dsp-size", "2", "--text-len", "8", "--num-frames", "8", "--latent-width", "4",
      "--video-buckets", "8,2,4;6,2,3"], 2,  # --num-frames/--latent-* pass; the second bucket does not
     ("(dsp size 2) in video bucket 6,2,3 (T,H,W) of --video-buckets '8,2,4;6,2,3': linear_qkv input: spatial "
      "layer tokens (6 patches x 3 local frames x micro batch 1): 18 rows x 16")),
    (["--transformer-impl", "transformer_engine", "--dsp-size", "4", "--video-buckets", "8,2,4;2,2,3"], 4,
     "dsp size (4) exceeds the frames (2) or patches (6) of a sample (a --video-buckets entry): some ranks"),
    (["--cuda-graph-impl", "transformer_engine", "--dsp-size", "2"], 2,
     "--cuda-graph-impl transformer_engine: CUDA graphs are not supported with DSP layers"),
    (["--cuda-graph-impl", "local", "--dsp-size", "2"], 2, "--cuda-graph-impl local: CUDA graphs are not supported"),
    (["--external-cuda-graph", "--dsp-size", "2"], 2, "--external-cuda-graph: CUDA graphs are not supported"),
    (["--init-model-with-meta-device", "--dsp-size", "2"], 2,
     "--init-model-with-meta-device is not supported with DSP layers: Megatron materialises meta parameters"),
])
def test_unsupported_options_and_shapes_fail_while_parsing(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                           world_size: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(monkeypatch, ["--sequence-parallel-mode", "dsp", *GEOMETRY, *argv], world_size, validate=False,
              provider=_with_model_arguments)
    assert message in str(info.value)


def test_dsp_mode_installs_the_model_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under dsp mode, megatron.training's get_model refuses a model without DSP layers."""
    from megatron.training import training
    from torch import nn

    from dsp_plugin.megatron.tokens import require_dsp_layers

    parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "2"], world_size=2, validate=False)
    assert getattr(training.get_model, "_dsp_checked", False)
    with pytest.raises(ValueError, match="has no DSPSpatialTemporalLayer, so the DSP group would only act as"):
        require_dsp_layers(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(("argv", "world_size", "message"), [
    (["--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--tensor-model-parallel-size", "2"], 6,
     "world size (6) is not divisible by tensor model parallel size (2) x dsp size (4) x pipeline model "
     "parallel size (1) = 8"),
    (["--sequence-parallel-mode", "dsp", "--tensor-model-parallel-size", "4"], 6,
     "world size (6) is not divisible by tensor model parallel size (4) x pipeline model parallel size (1) = 4"),
    (["--sequence-parallel-mode", "dsp", "--dsp-size", "2", "--context-parallel-size", "2"], 8,
     "--sequence-parallel-mode dsp is incompatible with --context-parallel-size (2)"),
    (["--dsp-size", "2"], 2, "--dsp-size (2) requires --sequence-parallel-mode dsp"),
    (["--dsp-comm-dtype", "fp8"], 2, "--dsp-comm-dtype fp8 requires --sequence-parallel-mode dsp"),
    (["--sequence-parallel-mode", "dsp", "--calculate-per-token-loss"], 2,
     "--sequence-parallel-mode dsp is incompatible with --calculate-per-token-loss"),
    (["--sequence-parallel-mode", "dsp", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"], 4,
     "does not support the interleaved (virtual) pipeline schedule yet: got "
     "--num-layers-per-virtual-pipeline-stage (1)"),
    (["--sequence-parallel-mode", "dsp", "--dsp-size", "0"], 2, "--dsp-size must be a positive integer, got 0"),
    (["--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--seq-length", "36"], 4,
     "--seq-length (36) must be a multiple of 2 x dsp size (4) = 8"),
])
def test_bad_combinations_fail_while_parsing(monkeypatch: pytest.MonkeyPatch, argv: list[str], world_size: int,
                                             message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(monkeypatch, argv, world_size, validate=False)
    assert message in str(info.value)


def test_unknown_mode_is_an_argparse_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse(monkeypatch, ["--sequence-parallel-mode", "ulysses"], world_size=1, validate=False)
    assert "invalid choice: 'ulysses'" in capsys.readouterr().err


def test_dsp_comm_dtype_reaches_the_layers_config(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """``--dsp-comm-dtype fp8`` lands in ``DSPTransformerConfig.dsp_comm_dtype`` the way Megatron builds the
    config from the arguments (the layers read it there); an unknown format is argparse's error."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from dsp_plugin.megatron.config import DSPTransformerConfig

    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "2", "--dsp-comm-dtype", "fp8"],
                 world_size=2)
    args.context_parallel_size = 1      # as model_config_from_args does: attention stays local
    assert core_transformer_config_from_args(args, config_class=DSPTransformerConfig).dsp_comm_dtype == "fp8"
    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "2"], world_size=2)
    args.context_parallel_size = 1
    assert core_transformer_config_from_args(args, config_class=DSPTransformerConfig).dsp_comm_dtype is None
    with pytest.raises(SystemExit):
        parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-comm-dtype", "e5m2"], world_size=2,
              validate=False)
    assert "invalid choice: 'e5m2'" in capsys.readouterr().err


def test_parse_and_validate_args_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point a launch calls, global variables included."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import destroy_global_vars, get_args

    from dsp_plugin.megatron.cpu import cuda_shim

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_stdit.py", *BASE, "--sequence-parallel-mode", "dsp"])
    try:
        with cuda_shim():
            parse_and_validate_args(extra_args_provider=add_dsp_arguments)
        args = get_args()
        assert (args.dsp_size, args.context_parallel_size, args.data_parallel_size) == (4, 4, 1)
    finally:   # every global parse_and_validate_args set, so a later test's pretrain() may set them again
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

        destroy_global_vars()
        destroy_num_microbatches_calculator()


def test_documented_fp8_line_passes_the_shape_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/composition.md: IMPL=transformer_engine FP8=hybrid NPROC=8 DSP=4 FRAMES=16 HEIGHT=8 WIDTH=8 TEXT_LEN=16."""
    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--fp8-format", "hybrid",
                               "--transformer-impl", "transformer_engine", "--num-frames", "16", "--latent-height",
                               "8", "--latent-width", "8", "--text-len", "16", "--seq-length", "1024"],
                 world_size=8, validate=False, provider=_with_model_arguments)
    assert (args.dsp_size, args.context_parallel_size) == (4, 4)


# -- FP8: the parse-time check against Transformer Engine's rule on the GEMMs the model really runs -------


def te_accepts(shape: tuple[int, ...], recipe: str) -> bool:
    """Transformer Engine's rule for one FP8 GEMM operand: ``assert_dim_for_fp8_exec`` (rows % 8, last dim
    % 16, inputs and weights, every recipe) and, for MXFP8, ``MXFP8Quantizer``'s 1x32 blocks (both % 32)."""
    rows, last = math.prod(shape[:-1]), shape[-1]
    ok = rows % 8 == 0 and last % 16 == 0
    return ok and (recipe != "mxfp8" or (rows % 32 == 0 and last % 32 == 0))


def gemm_operands(args) -> list[tuple[int, ...]]:
    """Shapes of every input and weight entering a tensor-parallel linear in one forward of the launch's
    model (DSP=1, one rank; the local linears stand where TE's would)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from dsp_plugin.megatron.groups import install_topology
    from dsp_plugin.megatron.steps import SyntheticVideoDataset, build_model, model_config_from_args
    from dsp_plugin.megatron.steps import video_shape_from_args

    from dsp_plugin.megatron.cpu import cuda_shim

    install_topology()
    video = video_shape_from_args(args)
    args.transformer_impl = "local"  # the local spec has the same GEMMs as the TE one
    with cuda_shim():
        model = build_model(model_config_from_args(args), video, text_dim=args.text_dim, text_len=args.text_len)
    shapes: list[tuple[int, ...]] = []

    def record(module, inputs, output) -> None:
        shapes.extend([tuple(inputs[0].shape), tuple(module.weight.shape)])

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.register_forward_hook(record)
    item = SyntheticVideoDataset(video, 1, text_dim=args.text_dim, text_len=args.text_len)[0]
    batch = {k: v[None].expand(args.micro_batch_size, *v.shape) for k, v in item.items()}
    with torch.no_grad():
        model(batch["latents"], batch["timestep"], batch["text"])
    return shapes


GEO = ["--num-frames", "4", "--latent-height", "2", "--latent-width"]
FP8_CASES = [  # (argv, recipe, TE accepts): frames x height x width, text tokens, hidden, micro batch
    pytest.param([*GEO, "3", "--text-len", "8"], "delayed", True, id="24rows"),
    pytest.param([*GEO, "3", "--text-len", "4"], "delayed", False, id="text4"),
    pytest.param([*GEO, "4", "--text-len", "8", "--hidden-size", "40", "--ffn-hidden-size", "160"], "delayed",
                 False, id="hidden40"),
    pytest.param([*GEO, "3", "--text-len", "8"], "mxfp8", False, id="mxfp8-24rows"),
    pytest.param([*GEO, "4", "--text-len", "32", "--hidden-size", "32", "--ffn-hidden-size", "128"], "mxfp8",
                 True, id="mxfp8-32rows"),
    pytest.param([*GEO, "3", "--text-len", "4", "--micro-batch-size", "2"], "blockwise", True, id="blockwise-mbs2"),
]


@pytest.mark.parametrize(("argv", "recipe", "expected"), FP8_CASES)
def test_fp8_check_is_transformer_engines_rule(monkeypatch: pytest.MonkeyPatch, one_rank, argv: list[str],
                                               recipe: str, expected: bool) -> None:
    """DSP size 1 (the check used to skip it): the parse-time check accepts exactly when every GEMM operand
    of a real forward passes TE's rule."""
    base = ["--sequence-parallel-mode", "dsp", "--dsp-size", "1", "--text-dim", "16", "--seq-length", "48",
            "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--normalization", "LayerNorm"]
    args = parse(monkeypatch, [*base, *argv], world_size=1, provider=_with_model_arguments)
    operands = gemm_operands(args)
    te_ok = all(te_accepts(shape, recipe) for shape in operands)
    args.fp8, args.fp8_recipe = "hybrid", recipe
    message = ""
    try:
        check_fp8_shapes(args, 1)
    except ValueError as error:
        message = str(error)
    print(f"\n{recipe} {argv}: TE's rule {'accepts' if te_ok else 'rejects'} "
          f"{sorted(set(s for s in operands if not te_accepts(s, recipe)))}; parse-time check: "
          f"{message[message.find('(dsp size'):][:200] or 'accepts'}")
    assert te_ok == expected and (not message) == te_ok


def test_flops_hook_is_called_the_way_train_calls_it() -> None:
    """``install_flops_formula`` replaces Megatron's function with one of the same signature; called exactly as
    ``train()`` and ``training_log()`` call it (training.py: ``consume_seqlen_stats_in_iteration`` then the
    keywords), it gives 3 forwards of this model per sample."""
    import argparse
    import inspect

    from megatron.training import training

    from dsp_plugin.megatron.flops import forward_flops_per_sample, install_flops_formula

    original = training.num_floating_point_operations
    install_flops_formula()
    try:
        hook = training.num_floating_point_operations
        assert hook is not original
        assert list(inspect.signature(hook).parameters) == list(inspect.signature(original).parameters)
        args = argparse.Namespace(num_frames=8, latent_height=2, latent_width=3, latent_channels=4, hidden_size=32,
                                  ffn_hidden_size=128, num_layers=4, text_dim=16, text_len=4)
        total_real_tokens_in_batch, seqlen_squared_sum_in_batch = training.consume_seqlen_stats_in_iteration()
        flops = training.num_floating_point_operations(
            args, 4, seqlen_squared_sum_in_batch=seqlen_squared_sum_in_batch,
            total_real_tokens_in_batch=total_real_tokens_in_batch)
        per_sample = forward_flops_per_sample(frames=8, patches=6, channels=4, hidden=32, ffn_hidden=128,
                                              num_layers=4, text_len=4, text_dim=16)
        assert flops == 3 * 4 * per_sample > 0
    finally:
        training.num_floating_point_operations = original


def test_parameters_are_created_where_megatron_creates_its_own(monkeypatch: pytest.MonkeyPatch, one_rank) -> None:
    """Without ``use_cpu_initialization`` megatron-core puts its parameters on ``torch.cuda.current_device()``;
    the model's own modules (embeddings, adaLN, head) must follow. The current device is made ``meta`` here
    (no GPU needed): every parameter, Megatron's and ours, must land there; with ``use_cpu_initialization``
    every one is on the CPU."""
    from dsp_plugin.megatron.groups import install_topology
    from dsp_plugin.megatron.model import VideoShape
    from dsp_plugin.megatron.steps import build_model, dsp_config

    install_topology()
    video = VideoShape(4, 4, 2, 2)
    common = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  perform_initialization=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    on_device = build_model(dsp_config(video, use_cpu_initialization=False, **common), video, text_dim=8, text_len=4)
    devices = {name: p.device.type for name, p in on_device.named_parameters()}
    assert set(devices.values()) == {"meta"}, {n: d for n, d in devices.items() if d != "meta"}
    on_cpu = build_model(dsp_config(video, use_cpu_initialization=True, **common), video, text_dim=8, text_len=4)
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU shim")
def test_training_shim_answers_pretrains_queries_and_puts_everything_back() -> None:
    from dsp_plugin.megatron.cpu import cuda_shim

    originals = (torch.cuda.is_available, torch.cuda.device_count, torch.accelerator.current_stream)
    with cuda_shim(training=True):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 0 == torch.cuda.max_memory_allocated()
        assert torch.ones(2).pin_memory().device.type == "cpu" == torch.zeros(1, device="cuda").device.type
        assert not torch.accelerator.current_stream().is_capturing() and torch._dynamo.config.disable
    assert (torch.cuda.is_available, torch.cuda.device_count, torch.accelerator.current_stream) == originals
    assert not torch.cuda.is_available() and not torch._dynamo.config.disable
