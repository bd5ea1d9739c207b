"""The arguments ``megatron.training.pretrain()`` parses for the paper's STDiT: Megatron's own, DSP's flag
(``arguments``), the latent video geometry (``steps.add_model_arguments``) and the load checks (``resume``).

``python -m dsp_plugin.launch.pretrain_stdit`` parses them; the dry run (``dsp_plugin.dryrun``) parses
the same ones to build the model it measures.
"""

from __future__ import annotations

import argparse
import re

from dsp_plugin.megatron.arguments import add_dsp_arguments
from dsp_plugin.megatron.resume import add_load_arguments
from dsp_plugin.megatron.steps import add_model_arguments

__all__ = ["ARGS_DEFAULTS", "escape_help_percents", "extra_args_provider"]

#: what the STDiT's ``pretrain()`` passes Megatron beside its own options (no tokenizer: latents, not text)
ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer", "vocab_size": 1}


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DSP options (the flag) plus the latent video geometry of the synthetic data."""
    return escape_help_percents(add_load_arguments(add_model_arguments(add_dsp_arguments(parser))))


def escape_help_percents(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--help`` formats every help string with ``%``; megatron-core has a bare one ("10%") that crashes it."""
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            # keep "%%" and "%(default)s"; double a bare "%"
            action.help = re.sub(r"%(%|\(\w+\)[a-z])?", lambda m: m.group(0) if m.group(1) else "%%", action.help)
    return parser
