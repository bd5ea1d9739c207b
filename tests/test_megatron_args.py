"""``--sequence-parallel-mode dsp`` through Megatron's real argument parsing and validation.

In-process: ``megatron.training.arguments.parse_args`` with the DSP
``extra_args_provider`` and then Megatron's own ``validate_args``. Every DSP
error is raised while parsing, i.e. before ``init_process_group`` on every rank.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.training")

from dsp_plugin.megatron.arguments import add_dsp_arguments  # noqa: E402

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
     "FP8 needs every GEMM's rows divisible by 16 on every DSP rank (dsp size 4): spatial layers (6 patches x"),
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
    finally:
        destroy_global_vars()


def test_documented_fp8_line_passes_the_shape_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/composition.md: IMPL=transformer_engine FP8=hybrid NPROC=8 DSP=4 FRAMES=16 HEIGHT=8 WIDTH=8 TEXT_LEN=16."""
    args = parse(monkeypatch, ["--sequence-parallel-mode", "dsp", "--dsp-size", "4", "--fp8-format", "hybrid",
                               "--transformer-impl", "transformer_engine", "--num-frames", "16", "--latent-height",
                               "8", "--latent-width", "8", "--text-len", "16", "--seq-length", "1024"],
                 world_size=8, validate=False, provider=_with_model_arguments)
    assert (args.dsp_size, args.context_parallel_size) == (4, 4)
