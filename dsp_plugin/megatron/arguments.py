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

__all__ = ["MODES", "add_dsp_arguments", "apply_dsp_arguments", "dsp_enabled"]

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
    args.dsp_size = dsp
    args.context_parallel_size = dsp
    args._dsp_applied = True
    return args


def dsp_enabled(args: argparse.Namespace) -> bool:
    """True when the launch asked for ``--sequence-parallel-mode dsp``."""
    return getattr(args, "sequence_parallel_mode", "none") == "dsp"
