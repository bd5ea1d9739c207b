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

__all__ = ["COMM_DTYPES", "FP8_RULES", "MODES", "add_dsp_arguments", "apply_dsp_arguments", "check_launch_options",
           "check_fp8_shapes", "check_models_for_dsp_layers", "dsp_enabled", "fp8_gemms", "launch_geometries"]

#: Values of ``--sequence-parallel-mode``.
MODES = ("none", "dsp")
#: Values of ``--dsp-comm-dtype`` (unset: the activations' own dtype); ``dsp_plugin.comm.payload``.
COMM_DTYPES = ("fp8",)

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
    group.add_argument("--dsp-comm-dtype", type=str, default=None, choices=COMM_DTYPES,
                       help="Wire format of the DSP switches and head switches (forward and backward). 'fp8': "
                            "each chunk sent as float8 e4m3 with a float32 scale (about half the bf16 bytes), "
                            "cast back after the receive. Default: the activations' own dtype (exact).")
    if not getattr(parser, _HOOKED, False):
        parse_known_args = parser.parse_known_args

        def parse_known_args_and_apply_dsp(args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
            parsed, rest = parse_known_args(args, namespace)
            apply_dsp_arguments(parsed, world_size=int(os.getenv("WORLD_SIZE", "1")))
            if dsp_enabled(parsed) or getattr(parsed, "num_frames", None) is not None:  # DSP layers in use
                check_launch_options(parsed)
            check_fp8_shapes(parsed, parsed.dsp_size)
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
    if mode == "dsp" or hasattr(args, "latent_channels"):  # DSP layers, or the launch's own DSP model
        check_position_embedding(args)
    dsp = getattr(args, "dsp_size", None)
    if mode == "none":
        if dsp not in (None, 1):
            raise ValueError(f"--dsp-size ({dsp}) requires --sequence-parallel-mode dsp "
                             "(got --sequence-parallel-mode none)")
        if getattr(args, "dsp_comm_dtype", None) is not None:
            raise ValueError(f"--dsp-comm-dtype {args.dsp_comm_dtype} requires --sequence-parallel-mode dsp "
                             "(got --sequence-parallel-mode none: nothing is switched)")
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


#: Transformer Engine's FP8 GEMM shape rule per ``--fp8-recipe``: (rows, last dim) of every GEMM
#: input and weight. TE's linears assert ``prod(shape[:-1]) % 8 == 0 and shape[-1] % 16 == 0`` on the
#: input and the weight (``assert_dim_for_fp8_exec``) under every recipe; MXFP8 quantizes 1x32 blocks
#: and asserts both dims % 32 (``MXFP8Quantizer.make_empty``). Blockwise (128-tiles) pads partial
#: tiles in its scales; Megatron aligns it like the per-tensor recipes (``get_fp8_align_size``: 16).
FP8_RULES = {"delayed": (8, 16), "tensorwise": (8, 16), "blockwise": (8, 16), "custom": (8, 16), "mxfp8": (32, 32)}


def launch_geometries(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """Every ``(frames, height, width)`` a launch's batches take: each ``--video-buckets`` entry, else
    ``--num-frames/--latent-height/--latent-width``; empty when the launch defines no geometry (a user's own)."""
    spec = getattr(args, "video_buckets", None)
    if spec:
        from dsp_plugin.megatron.steps import video_buckets_from_args

        return list(video_buckets_from_args(args))
    geometry = tuple(getattr(args, name, None) for name in ("num_frames", "latent_height", "latent_width"))
    return [] if None in geometry else [geometry]  # type: ignore[list-item]


def fp8_gemms(args: argparse.Namespace, dsp: int,
              geometry: tuple[int, int, int] | None = None) -> list[tuple[str, int, int]]:
    """``(name, rows, last dim)`` of every GEMM operand (inputs and weights) a DSP layer of the launch's
    model gives Transformer Engine on some DSP rank: spatial layers hold all S patches of T/dsp frames,
    temporal layers all T frames of S/dsp patches (uneven chunks both ways), cross-attention keys the
    text; weights are split over TP. ``geometry``: ``(frames, height, width)`` of the batches (default: the
    launch's ``--num-frames/--latent-height/--latent-width``)."""
    from dsp_plugin.comm import chunk_sizes

    frames, height, width = geometry or (args.num_frames, args.latent_height, args.latent_width)
    patches = height * width
    mbs, tp = getattr(args, "micro_batch_size", 1) or 1, _size(args, "tensor_model_parallel_size")
    hidden = args.hidden_size
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * hidden
    rows = {f"spatial layer tokens ({patches} patches x {t} local frames x micro batch {mbs})": patches * t * mbs
            for t in sorted(set(chunk_sizes(frames, dsp)))}
    rows |= {f"temporal layer tokens ({frames} frames x {s} local patches x micro batch {mbs})": frames * s * mbs
             for s in sorted(set(chunk_sizes(patches, dsp)))}
    text = bool(getattr(args, "text_dim", 0))
    if text:
        rows[f"cross-attention keys ({args.text_len} text tokens x micro batch {mbs})"] = args.text_len * mbs
    gemms = []
    for what, n in rows.items():  # inputs: [rows, in features] of each linear the tokens enter
        cross = what.startswith("cross")
        ins = [("linear_kv input", hidden)] if cross else [
            ("linear_qkv input", hidden), ("linear_proj input", hidden // tp), ("linear_fc1 input", hidden),
            ("linear_fc2 input", ffn // tp)] + ([("cross linear_q input", hidden),
                                                ("cross linear_proj input", hidden // tp)] if text else [])
        gemms += [(f"{name}: {what}", n, k) for name, k in ins]
    weights = [("linear_qkv", 3 * hidden // tp, hidden), ("linear_proj", hidden, hidden // tp),
               ("linear_fc1", ffn // tp, hidden), ("linear_fc2", hidden, ffn // tp)]
    if text:
        weights += [("cross linear_q", hidden // tp, hidden), ("cross linear_kv", 2 * hidden // tp, hidden),
                    ("cross linear_proj", hidden, hidden // tp)]
    gemms += [(f"{name} weight [{out} x {k}] (tp {tp})", out, k) for name, out, k in weights]
    return gemms


def check_fp8_shapes(args: argparse.Namespace, dsp: int) -> None:
    """Refuse an FP8 run whose GEMM shapes break TE's rule for ``--fp8-recipe`` (any DSP size, 1 included),
    for every geometry the batches take (each ``--video-buckets`` entry)."""
    if not (getattr(args, "fp8", None) or getattr(args, "fp8_format", None)):
        return
    geometries = launch_geometries(args)  # none: a user's own launch, whose geometry is not known here
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    row_align, dim_align = FP8_RULES.get(recipe, FP8_RULES["delayed"])
    for geometry in geometries:
        bad = [f"{what}: {rows} rows x {dim}" for what, rows, dim in fp8_gemms(args, dsp, geometry)
               if rows % row_align or dim % dim_align]
        if bad:
            where = (f" in video bucket {','.join(map(str, geometry))} (T,H,W) of --video-buckets "
                     f"{args.video_buckets!r}" if getattr(args, "video_buckets", None) else "")
            raise ValueError(f"FP8 (--fp8-recipe {recipe}) needs every GEMM input and weight with rows divisible "
                             f"by {row_align} and last dim divisible by {dim_align} (Transformer Engine's rule) on "
                             f"every DSP rank (dsp size {dsp}){where}: " + "; ".join(bad))


def check_launch_options(args: argparse.Namespace) -> None:
    """Megatron options the DSP layers cannot honour, refused while parsing.

    CUDA graphs capture the stock layer with static GPT-shaped inputs and never run the DSP forward.
    ``--init-model-with-meta-device``: Megatron then materialises the parameters with ``torch.empty``
    (``to_empty_if_meta_device``), dropping the adaLN zero-init and the weights a model draws (or copies
    from the reference) at construction.
    """
    if getattr(args, "init_model_with_meta_device", False):
        raise ValueError("--init-model-with-meta-device is not supported with DSP layers: Megatron materialises "
                         "meta parameters uninitialised (to_empty), which drops the adaLN zero-init and the "
                         "weights drawn at construction; drop it (parameters are created on the current device)")
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    legacy = [flag for flag in ("enable_cuda_graph", "external_cuda_graph") if getattr(args, flag, False)]
    if impl != "none" or legacy:
        given = f"--cuda-graph-impl {impl}" if impl != "none" else "--" + legacy[0].replace("_", "-")
        raise ValueError(f"{given}: CUDA graphs are not supported with DSP layers (Megatron's capture runs "
                         "the stock TransformerLayer with static GPT-shaped inputs, not the DSP forward and "
                         "its all-to-alls); use --cuda-graph-impl none")


def check_position_embedding(args: argparse.Namespace) -> None:
    """``--position-embedding-type`` values the DSP model takes (any mode; the launch's model is DSP layers).

    RoPE is computed from each token's global frame (and, with ``--spatial-rope``, patch) index along
    the attended dim, which DSP never shards; Megatron's fused RoPE kernel needs Transformer Engine.
    """
    from dsp_plugin.megatron.config import POSITION_EMBEDDINGS

    kind = getattr(args, "position_embedding_type", None)
    if kind is not None and kind not in POSITION_EMBEDDINGS:
        raise ValueError(f"--position-embedding-type {kind}: the spatial-temporal DSP layers take one of "
                         f"{', '.join(POSITION_EMBEDDINGS)} (rope: temporal RoPE from the global frame index)")
    if kind == "rope" and getattr(args, "apply_rope_fusion", False):
        from dsp_plugin.megatron.layers import te_available

        if not te_available():
            raise ValueError("--position-embedding-type rope: RoPE fusion (on by default) needs Transformer "
                             "Engine, which is not importable here; pass --no-rope-fusion")
    if getattr(args, "dsp_spatial_rope", False) and kind != "rope":
        raise ValueError(f"--spatial-rope needs --position-embedding-type rope, got {kind}")



def check_model_options(args: argparse.Namespace, dsp: int) -> None:
    """Options the DSP layers do not support, and shard shapes the chosen kernels cannot take.

    The geometry checks use ``--num-frames``/``--latent-height``/``--latent-width`` when the
    launch defines them (``dsp_plugin/launch/pretrain_stdit.py`` does); a user's own launch without
    them is checked for the options only.
    """
    if getattr(args, "sequence_parallel", False):
        raise ValueError("--sequence-parallel-mode dsp does not support --sequence-parallel (Megatron sequence "
                         "parallelism inside TP): DSP layers already shard the sequence; drop one of the two")
    if getattr(args, "recompute_granularity", None) == "selective":
        modules = set(getattr(args, "recompute_modules", None) or ["core_attn"])
        if modules - {"core_attn"}:
            raise ValueError(f"--sequence-parallel-mode dsp: --recompute-modules {sorted(modules)} is not "
                             "supported (DSP layers run their own norms and MLP); use core_attn, or "
                             "--recompute-granularity full")
    if dsp == 1 or getattr(args, "transformer_impl", "local") != "transformer_engine":
        return
    for frames, height, width in launch_geometries(args):  # every bucket the batches take
        patches = height * width
        if dsp > min(frames, patches):
            raise ValueError(f"dsp size ({dsp}) exceeds the frames ({frames}) or patches ({patches}) of a sample"
                             f"{' (a --video-buckets entry)' if getattr(args, 'video_buckets', None) else ''}: "
                             "some ranks would hold empty shards, which Transformer Engine kernels cannot take; "
                             "use --dsp-size <= min(frames, patches) or --transformer-impl local")


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
