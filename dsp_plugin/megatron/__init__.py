"""Megatron-LM integration: ``--sequence-parallel-mode dsp``.

- ``arguments``: the flag and ``--dsp-size`` through ``extra_args_provider``, validated at parse time;
  ``resume``: ``--load`` of nothing refused unless it is the ``--save`` directory (auto-resume).
- ``groups``: DSP in parallel_state's context-parallel slot; a ``Topology`` over Megatron's groups.
- ``config``: ``DSPTransformerConfig`` (attend pattern, RoPE, adaLN-single; no geometry) and the shard rules.
- ``dsp_layer``: ``DSPSpatialTemporalLayer``, a ``TransformerLayer`` that switches the shard
  itself; ``layers.dsp_layer_spec`` builds it (local for CPU, Transformer Engine for GPU).
- ``tokens``: entry/exit helpers (tagging the global frames and patches), checks for a user's own model.
- ``rope``: the rotary tables (1-D, 2-D, and 3-D in full layers) from each batch's global geometry.
- ``model``: the video DiT: embeddings, a stock ``TransformerBlock`` of DSP layers, the head.
- ``recompute``: full recompute without replaying the switch.
- ``weights``: load the plain-torch reference's weights (the oracle); ``flops``: its FLOPs.
- ``steps``: dataset, model provider, forward step and loss for ``megatron.training``.
- ``cpu``: the CUDA shim and train step that run the same pieces on gloo.

``import dsp_plugin.megatron`` loads only the argument code; the rest imports
megatron-core when first touched.
"""

from __future__ import annotations

import importlib
from typing import Any

from dsp_plugin.megatron.arguments import add_dsp_arguments, apply_dsp_arguments, dsp_enabled

__all__ = ["DSPSpatialTemporalLayer", "DSPTransformerConfig", "add_dsp_arguments", "apply_dsp_arguments",
           "dsp_enabled", "dsp_layer_spec", "forward_step", "gather_video_tokens", "install_topology",
           "model_provider", "require_dsp_layers", "shard_range", "split_video_tokens", "video_rope",
           "attach_video_grid"]

_LAZY = {"install_topology": "groups", "initialize_dsp_model_parallel": "groups",
         "model_provider": "steps", "forward_step": "steps", "STDiTMegatron": "model",
         "DSPTransformerConfig": "config", "DSPSpatialTemporalLayer": "dsp_layer", "dsp_layer_spec": "layers",
         "split_video_tokens": "tokens", "gather_video_tokens": "tokens", "require_dsp_layers": "tokens",
         "shard_range": "tokens", "video_rope": "rope", "attach_video_grid": "dsp_layer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"dsp_plugin.megatron.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'dsp_plugin.megatron' has no attribute {name!r}")
