"""Load the plain-torch reference's weights into any TP x DSP x PP layout of the Megatron model.

``dsp_plugin.models.stdit.STDiT`` (patch size 1, two axes, the same depth x 2
blocks) is the independent oracle: a Megatron run initialised from it must give
its outputs and gradients. :func:`megatron_names` maps a reference state dict
(or its gradients: the map is a pure re-layout, so it applies to gradients too)
to **global** Megatron parameter names with full, unsplit tensors;
:func:`load_reference_weights` keeps this rank's pipeline layers and TP chunk.

Re-layouts: the reference's ``q`` and ``kv`` become Megatron's interleaved
``linear_qkv`` rows ``[q_h, k_h, v_h]`` per head; cross-attention ``kv`` becomes
``linear_kv`` rows ``[k_h, v_h]`` per head; the (1,1,1) patch ``Conv3d`` becomes a
``Linear``. Everything else is a rename.
"""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state as ps
from torch import nn

__all__ = ["global_parameter_name", "load_reference_weights", "megatron_names", "parameter_device",
           "reference_config"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_RENAMES = {
    "attn.proj": "self_attention.linear_proj", "cross.q": "cross_attention.linear_q",
    "cross.proj": "cross_attention.linear_proj", "norm_cross": "pre_cross_attn_layernorm",
    "mlp.0": "mlp.linear_fc1", "mlp.2": "mlp.linear_fc2", "adaln.1": "adaln_modulation",
    "attn.q_norm": "self_attention.q_layernorm", "attn.k_norm": "self_attention.k_layernorm",
}
_TOP = {"t_embedder.mlp.0": "time_embed.0", "t_embedder.mlp.2": "time_embed.2", "text_proj": "text_proj",
        "final_layer.adaln.1": "final_adaln.1", "final_layer.linear": "head", "t_block.1": "t_block.1"}
#: parameters that are not a module's weight or bias (adaLN-single's tables)
_TABLES = {"final_layer.scale_shift_table": "final_scale_shift_table"}


def parameter_device(config: object) -> torch.device:
    """Where megatron-core creates a layer's parameters: the CPU under ``use_cpu_initialization``, else
    the current CUDA device (``torch.cuda.current_device()``, which the CPU shim answers with the CPU).
    Build a model's own modules under ``with torch.device(parameter_device(config))`` so they sit beside
    Megatron's and TE's."""
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    device = torch.cuda.current_device()
    return device if isinstance(device, torch.device) else torch.device("cuda", device)


def global_parameter_name(name: str, layer_offset: int) -> str:
    """``...layers.{i}.x`` -> ``...layers.{i + layer_offset}.x`` (the name in the single-stage model)."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


def reference_config(config: object, channels: int, text_dim: int | None, *, weights_only: bool = False) -> object:
    """The ``STDiTConfig`` of the reference matching a ``DSPTransformerConfig``.

    ``weights_only=True`` accepts any pattern of an even layer count: every layer
    kind (spatial, temporal, full) has an ``AxialBlock``'s parameters, so the
    alternating reference of the same depth draws the weights of any pattern (its
    forward is the oracle of the alternating pattern only).
    """
    from dsp_plugin.models.stdit import STDiTConfig

    alternating = tuple(config.dsp_attend_pattern) == ("spatial", "temporal")
    if config.num_layers % 2 or not (alternating or weights_only):
        raise ValueError("reference_config: the reference alternates spatial and temporal blocks; got "
                         f"num_layers={config.num_layers}, pattern={config.dsp_attend_pattern}")
    if not config.dsp_sincos_positions or config.position_embedding_type == "none":
        raise ValueError("reference_config: the reference always adds sin-cos positions where RoPE does not rotate")
    rope = config.position_embedding_type == "rope"
    return STDiTConfig(depth=config.num_layers // 2, hidden_size=config.hidden_size,
                       num_heads=config.num_attention_heads, mlp_ratio=config.ffn_hidden_size / config.hidden_size,
                       in_channels=channels, patch_size=(1, 1, 1), text_dim=text_dim, axes=2,
                       temporal_rope=rope, spatial_rope=rope and config.dsp_spatial_rope,
                       rope_base=float(config.rotary_base),
                       qk_norm=config.normalization if config.qk_layernorm else None,
                       adaln_single=config.dsp_adaln_single)


def _heads(t: torch.Tensor, parts: int, heads: int) -> torch.Tensor:
    """``[parts * D, ...] -> [parts, heads, D / heads, ...]``."""
    return t.reshape(parts, heads, t.shape[0] // (parts * heads), *t.shape[1:])


def megatron_names(reference: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """Reference state (or gradient) dict -> ``{global Megatron name: full tensor}``."""
    out: dict[str, torch.Tensor] = {}
    for name, value in reference.items():
        if name in _TABLES:
            out[_TABLES[name]] = value
        elif name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            prefix = f"decoder.layers.{index}."
            if rest == "scale_shift_table":
                out[prefix + rest] = value
                continue
            module, kind = rest.rsplit(".", 1)
            if module == "attn.q":
                continue  # with attn.kv below
            if module == "attn.kv":
                q = _heads(reference[f"blocks.{index}.attn.q.{kind}"], 1, num_heads)
                qkv = torch.cat([q, _heads(value, 2, num_heads)], dim=0)  # [3, H, hd, ...]
                out[f"{prefix}self_attention.linear_qkv.{kind}"] = qkv.transpose(0, 1).reshape(-1, *value.shape[1:])
            elif module == "cross.kv":
                kv = _heads(value, 2, num_heads).transpose(0, 1)  # [H, 2, hd, ...]
                out[f"{prefix}cross_attention.linear_kv.{kind}"] = kv.reshape(value.shape)
            else:
                out[f"{prefix}{_RENAMES[module]}.{kind}"] = value
        elif name.startswith("embedder.proj."):
            kind = name.rsplit(".", 1)[1]
            out[f"patch_embed.{kind}"] = value.reshape(value.shape[0], -1) if kind == "weight" else value
        else:
            module, kind = name.rsplit(".", 1)
            out[f"{_TOP[module]}.{kind}"] = value
    return out


@torch.no_grad()
def load_reference_weights(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    """Copy the reference's weights into this stage's parameters (this TP rank's chunk)."""
    full = megatron_names(reference, model.config.num_attention_heads)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, param in model.named_parameters():
        key = global_parameter_name(name, model.layer_offset)
        if key not in full:
            raise KeyError(f"load_reference_weights: no reference weight for {key} (have {sorted(full)[:8]}...)")
        value = full[key]
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            value = value.chunk(tp, dim=param.partition_dim)[tp_rank]
        if value.shape != param.shape:
            raise ValueError(f"load_reference_weights: {key} has shape {tuple(param.shape)} here, the reference "
                             f"gives {tuple(value.shape)}")
        param.copy_(value.to(dtype=param.dtype, device=param.device))
