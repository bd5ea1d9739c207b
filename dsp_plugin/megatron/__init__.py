"""Megatron-LM integration: ``--sequence-parallel-mode dsp``.

- ``arguments``: the flag and ``--dsp-size`` through ``extra_args_provider``, validated at parse time.
- ``groups``: DSP in parallel_state's context-parallel slot; a ``Topology`` over Megatron's groups.
- ``layers``: ModuleSpecs (local for CPU, Transformer Engine + FP8 for GPU) of megatron-core
  ``TransformerLayer``s with bidirectional, local attention.
- ``model``: the spatial-temporal model, switches between stages, sharded pipeline activations.
- ``steps``: dataset, model provider, forward step and loss for ``megatron.training``.
- ``cpu``: the CUDA shim and train step that run the same pieces on gloo.

``import dsp_plugin.megatron`` loads only the argument code; the rest imports
megatron-core when first touched.
"""

from __future__ import annotations

import importlib
from typing import Any

from dsp_plugin.megatron.arguments import add_dsp_arguments, apply_dsp_arguments, dsp_enabled

__all__ = ["add_dsp_arguments", "apply_dsp_arguments", "dsp_enabled", "install_topology",
           "model_provider", "forward_step"]

_LAZY = {"install_topology": "groups", "initialize_dsp_model_parallel": "groups",
         "model_provider": "steps", "forward_step": "steps", "STDiTMegatron": "model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"dsp_plugin.megatron.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'dsp_plugin.megatron' has no attribute {name!r}")
