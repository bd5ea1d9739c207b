"""The ModuleSpec of the DSP layer and the submodules it needs (local for CPU, Transformer Engine for GPU).

``dsp_layer_spec()`` builds :class:`~dsp_plugin.megatron.dsp_layer.DSPSpatialTemporalLayer`
from megatron-core's own ``SelfAttention``, ``CrossAttention`` and ``MLP``, the way
``gpt_layer_specs.py`` does for GPT:

- ``local``: ``ColumnParallelLinear`` / ``RowParallelLinear`` with
  :class:`SDPACoreAttention` as core attention. Megatron's own local
  ``DotProductAttention`` allocates its score buffer with
  ``torch.cuda.current_device()``; the torch SDPA kernel runs on CPU and GPU alike.
- ``transformer_engine``: ``TEColumnParallelLinear``, ``TERowParallelLinear``,
  ``TEDotProductAttention``, imported lazily so this module imports on a CPU
  machine. No norm is fused into a linear: adaLN modulates between them.
  ``TransformerBlock`` opens the FP8 contexts when ``config.fp8`` is set.

Attention stays local: DSP never shards the dim a layer attends along, and the
config keeps ``context_parallel_size == 1`` even though the DSP group sits in
parallel_state's context-parallel slot, so TE does not start its own ring
attention. TP splits heads (QKV column-parallel, output row-parallel) and the
MLP inside each layer, as in any Megatron GPT layer.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from dsp_plugin.megatron.core_attention import SDPACoreAttention

__all__ = ["SDPACoreAttention", "SequenceParallelTorchNorm", "dsp_layer_spec", "non_affine_layer_norm",
           "te_available"]


class SequenceParallelTorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch LayerNorm/RMSNorm), allowing Megatron-SP.

    Megatron's wrapper refuses ``config.sequence_parallel`` (it leaves that to Apex
    and TE norms). Under Megatron-SP a norm sees 1/TP of the tokens, so its weight
    gradient is partial over TP; marking the parameters ``sequence_parallel`` makes
    ``finalize_model_grads`` all-reduce them over TP, exactly what it does for the
    fused norms. Without SP this is plain ``torch.nn.LayerNorm``.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"SequenceParallelTorchNorm: normalization={config.normalization!r}; "
                             "expected 'LayerNorm' or 'RMSNorm'")
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def te_available() -> bool:
    """True when transformer_engine imports (it needs CUDA; never on the CPU CI machine)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from missing CUDA libraries
        return False
    return True


def non_affine_layer_norm(config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                          **_: Any) -> torch.nn.Module:
    """LayerNorm without weight and bias: adaLN supplies scale and shift per sample (DiT)."""
    return torch.nn.LayerNorm(hidden_size, eps=eps, elementwise_affine=False)


def dsp_layer_spec(transformer_impl: str = "local", *, cross_attention: bool = True) -> ModuleSpec:
    """ModuleSpec of :class:`~dsp_plugin.megatron.dsp_layer.DSPSpatialTemporalLayer` for a ``TransformerBlock``.

    ``local``: ``ColumnParallelLinear``/``RowParallelLinear`` and :class:`SDPACoreAttention`
    (CPU and GPU). ``transformer_engine``: TE linears and ``TEDotProductAttention``
    (imported only here, GPU). Norms before attention and MLP are affine-free
    (adaLN modulates them), so no norm is fused into a linear; the norm before
    cross-attention is a plain affine LayerNorm. Self-attention is unmasked;
    cross-attention takes the caption key-padding mask (``padding``). q and k
    norms (over each head's dims) are built when ``config.qk_layernorm`` is set:
    torch's LayerNorm/RMSNorm (``config.normalization``) locally, ``TENorm`` with TE.
    """
    from functools import partial

    from megatron.core.transformer.attention import (
        CrossAttention,
        CrossAttentionSubmodules,
        SelfAttention,
        SelfAttentionSubmodules,
    )
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from dsp_plugin.megatron.full_attention import DSPVideoLayer  # spatial/temporal, or full (head switch)

    if transformer_impl == "local":
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear as column
        from megatron.core.tensor_parallel.layers import RowParallelLinear as row

        core: Any = SDPACoreAttention
        qk_norm: Any = SequenceParallelTorchNorm
    elif transformer_impl == "transformer_engine":
        if not te_available():
            raise RuntimeError("dsp_layer_spec: transformer_engine is not importable here (it needs CUDA); "
                               "use --transformer-impl local on CPU")
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column
        from megatron.core.extensions.transformer_engine import TEDotProductAttention as core
        from megatron.core.extensions.transformer_engine import TENorm as qk_norm
        from megatron.core.extensions.transformer_engine import TERowParallelLinear as row
    else:
        raise ValueError(f"dsp_layer_spec: transformer_impl={transformer_impl!r}; expected 'local' or "
                         "'transformer_engine'")
    no_mask = {"attn_mask_type": AttnMaskType.no_mask}
    submodules = TransformerLayerSubmodules(
        input_layernorm=non_affine_layer_norm,
        self_attention=ModuleSpec(module=SelfAttention, params=no_mask, submodules=SelfAttentionSubmodules(
            linear_qkv=column, core_attention=core, linear_proj=row, q_layernorm=qk_norm, k_layernorm=qk_norm)),
        pre_mlp_layernorm=non_affine_layer_norm,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
    )
    if cross_attention:
        submodules.pre_cross_attn_layernorm = SequenceParallelTorchNorm
        # the caption's key padding (SDPA); TE's padding type would demand a mask on every call
        padding = {"attn_mask_type": AttnMaskType.padding} if transformer_impl == "local" else no_mask
        submodules.cross_attention = ModuleSpec(module=CrossAttention, params=padding,
                                                submodules=CrossAttentionSubmodules(
                                                    linear_q=column, linear_kv=column, core_attention=core,
                                                    linear_proj=row))
    return ModuleSpec(module=DSPVideoLayer, submodules=submodules)
