"""``--sequence-parallel-mode {none,dsp}`` and ``--dsp-size``, through Megatron's ``extra_args_provider``.

An existing launch adds one provider and one flag::

    args = parse_and_validate_args(extra_args_provider=add_dsp_arguments)
    ... --sequence-parallel-mode dsp --dsp-size 4

``add_dsp_arguments`` registers the two options and hooks the parser so that,
right after parsing and before Megatron's ``validate_args``, the DSP options are
checked and translated: ``--dsp-size N`` becomes ``context_parallel_size = N``,
which puts the DSP group in parallel_state's context-parallel slot and makes
Megatron compute ``data_parallel_size = world / (tp * dsp * pp)`` itself. The
hook is needed because ``parse_and_validate_args`` validates immediately after
parsing; the provider is the only place an integration can reach in between.

Validation happens during argument parsing, i.e. on every rank and before
``init_process_group``, so a bad combination cannot leave a rank waiting in a
collective. Errors are ``ValueError``s in Megatron's wording, naming every value.

Megatron's own ``--sequence-parallel`` (sequence parallelism inside TP) is a
different option and keeps working beside ``--sequence-parallel-mode``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["MODES", "add_dsp_arguments", "apply_dsp_arguments", "check_models_for_dsp_layers", "dsp_enabled"]

#: Values of ``--sequence-parallel-mode``.
MODES = ("none", "dsp")

_HOOKED = "_dsp_plugin_hooked"


def add_dsp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add the DSP options and the post-parse check."""
    group = parser.add_argument_group(title="dynamic sequence parallelism (dsp_plugin)")
    group.add_argument("--sequence-parallel-mode", type=str, default="none", choices=MODES,
                       help="Multi-dimensional sequence parallelism. 'dsp' shards activations along a "
                            "dim the current block does not attend along and re-shards with one "
                            "all-to-all between spatial and temporal blocks. Independent of "
                            "--sequence-parallel (Megatron's sequence parallelism inside TP).")
    group.add_argument("--dsp-size", type=int, default=None,
                       help="Ranks per DSP group (occupies Megatron's context-parallel slot). "
                            "Default with --sequence-parallel-mode dsp: every rank that TP and PP "
                            "leave, i.e. data-parallel size 1.")
    if not getattr(parser, _HOOKED, False):
        parse_known_args = parser.parse_known_args

        def parse_known_args_and_apply_dsp(args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
            parsed, rest = parse_known_args(args, namespace)
            apply_dsp_arguments(parsed, world_size=int(os.getenv("WORLD_SIZE", "1")))
            if dsp_enabled(parsed):
                check_models_for_dsp_layers()
            return parsed, rest

        parser.parse_known_args = parse_known_args_and_apply_dsp  # type: ignore[method-assign]
        setattr(parser, _HOOKED, True)
    return parser


def _size(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name, 1)
    return 1 if value is None else int(value)


def apply_dsp_arguments(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """Check the DSP options against the rest of the arguments and map DSP onto the CP slot.

    Idempotent. After it, ``args.dsp_size`` is the DSP size (1 when the mode is
    ``none``) and, in ``dsp`` mode, ``args.context_parallel_size == args.dsp_size``.
    """
    if getattr(args, "_dsp_applied", False):
        return args
    mode = getattr(args, "sequence_parallel_mode", "none")
    if mode not in MODES:
        raise ValueError(f"--sequence-parallel-mode {mode!r} is not one of {', '.join(MODES)}")
    dsp = getattr(args, "dsp_size", None)
    if mode == "none":
        if dsp not in (None, 1):
            raise ValueError(f"--dsp-size ({dsp}) requires --sequence-parallel-mode dsp "
                             "(got --sequence-parallel-mode none)")
        args.dsp_size = 1
        args._dsp_applied = True
        return args

    tp = _size(args, "tensor_model_parallel_size")
    pp = _size(args, "pipeline_model_parallel_size")
    cp = _size(args, "context_parallel_size")
    if cp != 1:
        raise ValueError(f"--sequence-parallel-mode dsp is incompatible with --context-parallel-size ({cp}): "
                         "DSP occupies Megatron's context-parallel slot; use --dsp-size instead")
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError("--sequence-parallel-mode dsp is incompatible with "
                         f"--hierarchical-context-parallel-sizes ({args.hierarchical_context_parallel_sizes})")
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError("--sequence-parallel-mode dsp is incompatible with --hybrid-context-parallel")
    if getattr(args, "calculate_per_token_loss", False):
        raise ValueError("--sequence-parallel-mode dsp is incompatible with --calculate-per-token-loss: "
                         "the DSP loss is a mean over each sample's tokens, scaled by the DSP size "
                         "the way Megatron scales context-parallel losses")
    for virtual in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        if getattr(args, virtual, None) is not None:
            raise ValueError(f"--sequence-parallel-mode dsp does not support the interleaved (virtual) pipeline "
                             f"schedule yet: got --{virtual.replace('_', '-')} ({getattr(args, virtual)})")
    if dsp is None:
        if world_size % (tp * pp):
            raise ValueError(f"world size ({world_size}) is not divisible by tensor model parallel size "
                             f"({tp}) x pipeline model parallel size ({pp}) = {tp * pp}")
        dsp = world_size // (tp * pp)
    if not isinstance(dsp, int) or dsp < 1:
        raise ValueError(f"--dsp-size must be a positive integer, got {dsp!r}")
    model = tp * dsp * pp
    if world_size % model:
        raise ValueError(f"world size ({world_size}) is not divisible by tensor model parallel size ({tp}) "
                         f"x dsp size ({dsp}) x pipeline model parallel size ({pp}) = {model}")
    seq_length = getattr(args, "seq_length", None)
    if dsp > 1 and seq_length is not None and seq_length % (2 * dsp):
        raise ValueError(f"--seq-length ({seq_length}) must be a multiple of 2 x dsp size ({dsp}) = {2 * dsp}: "
                         "Megatron's validate_args applies its context-parallel rule to the slot DSP "
                         "occupies (DSP itself splits any length)")
    check_model_options(args, dsp)
    args.dsp_size = dsp
    args.context_parallel_size = dsp
    args._dsp_applied = True
    return args


#: rows of every TE GEMM input under FP8 must divide by this (16 covers the stricter recipes)
FP8_ROW_ALIGNMENT = 16


def check_model_options(args: argparse.Namespace, dsp: int) -> None:
    """Options the DSP layers do not support, and shard shapes the chosen kernels cannot take.

    The geometry checks use ``--num-frames``/``--latent-height``/``--latent-width`` when the
    launch defines them (``dsp_plugin/launch/pretrain_stdit.py`` does); a user's own launch without
    them is checked for the options only.
    """
    if getattr(args, "sequence_parallel", False):
        raise ValueError("--sequence-parallel-mode dsp does not support --sequence-parallel (Megatron sequence "
                         "parallelism inside TP): DSP layers already shard the sequence; drop one of the two")
    rope = getattr(args, "position_embedding_type", None)
    if rope in ("rope", "mrope", "yarn"):
        raise ValueError(f"--sequence-parallel-mode dsp does not support --position-embedding-type {rope}: "
                         "Megatron slices rotary embeddings by context-parallel rank, which is not the DSP "
                         "shard; DSP layers add sin-cos positions along the dim they attend (never sharded)")
    if getattr(args, "recompute_granularity", None) == "selective":
        modules = set(getattr(args, "recompute_modules", None) or ["core_attn"])
        if modules - {"core_attn"}:
            raise ValueError(f"--sequence-parallel-mode dsp: --recompute-modules {sorted(modules)} is not "
                             "supported (DSP layers run their own norms and MLP); use core_attn, or "
                             "--recompute-granularity full")
    frames = getattr(args, "num_frames", None)
    height, width = getattr(args, "latent_height", None), getattr(args, "latent_width", None)
    if frames is None or height is None or width is None or dsp == 1:
        return
    patches = height * width
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if te and dsp > min(frames, patches):
        raise ValueError(f"dsp size ({dsp}) exceeds the frames ({frames}) or patches ({patches}) of a sample: "
                         "some ranks would hold empty shards, which Transformer Engine kernels cannot take; "
                         "use --dsp-size <= min(frames, patches) or --transformer-impl local")
    if getattr(args, "fp8", None) or getattr(args, "fp8_format", None):
        from dsp_plugin.comm import chunk_sizes

        mbs = getattr(args, "micro_batch_size", 1) or 1
        rows = {f"spatial layers ({patches} patches x {t} local frames x micro batch {mbs})": patches * t * mbs
                for t in set(chunk_sizes(frames, dsp))}
        rows |= {f"temporal layers ({frames} frames x {s} local patches x micro batch {mbs})": frames * s * mbs
                 for s in set(chunk_sizes(patches, dsp))}
        text_len, text_dim = getattr(args, "text_len", 0), getattr(args, "text_dim", 0)
        if text_dim:
            rows[f"cross-attention keys ({text_len} text tokens x micro batch {mbs})"] = text_len * mbs
        bad = {what: n for what, n in rows.items() if n % FP8_ROW_ALIGNMENT}
        if bad:
            listed = "; ".join(f"{what} = {n} rows" for what, n in bad.items())
            raise ValueError(f"FP8 needs every GEMM's rows divisible by {FP8_ROW_ALIGNMENT} on every DSP rank "
                             f"(dsp size {dsp}): {listed}")


def check_models_for_dsp_layers() -> None:
    """Wrap ``megatron.training``'s ``get_model`` so a model without DSP layers is refused under DSP.

    Without a ``DSPSpatialTemporalLayer`` the DSP group would only be Megatron's
    context-parallel group: TE ring attention or, with local attention, each rank
    attending over its own chunk only. Installed once, by the argument hook.
    """
    from megatron.training import training

    if getattr(training.get_model, "_dsp_checked", False):
        return
    original = training.get_model

    def get_model(*args: Any, **kwargs: Any) -> Any:
        from dsp_plugin.megatron.tokens import require_dsp_layers

        model = original(*args, **kwargs)
        if dsp_enabled(training.get_args()):  # decided per call: the hook outlives one launch in tests
            for chunk in model if isinstance(model, list) else [model]:
                require_dsp_layers(chunk)
        return model

    get_model._dsp_checked = True  # type: ignore[attr-defined]
    training.get_model = get_model


def dsp_enabled(args: argparse.Namespace) -> bool:
    """True when the launch asked for ``--sequence-parallel-mode dsp``."""
    return getattr(args, "sequence_parallel_mode", "none") == "dsp"
