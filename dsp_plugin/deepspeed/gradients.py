"""One gradient convention for every ZeRO stage: SUM over DSP, MEAN over DP.

The DSP primitives are exact adjoints with no scaling, so each rank of a DSP
group holds a partial gradient (the contribution of its shard of the sequence);
the gradient of the global batch is the sum over the DSP group, averaged over
data-parallel replicas. What DeepSpeed 0.19 does with our SP-aware ``mpu``
(sources: ``runtime/engine.py``, ``zero/stage_1_and_2.py``, ``zero/stage3.py``;
measured by ``python -m tests.test_deepspeed_convention``):

=====  ===========================================  ===================  ==========================
stage  DeepSpeed alone                              result               the plugin
=====  ===========================================  ===================  ==========================
0      all_reduce over DP x DSP, / (seq_dp / sp)    sum DSP, mean DP     nothing
1, 2   (reduce-)scatter over DP x DSP, / (seq_dp/sp)  sum DSP, mean DP     nothing
3      partitions over ``mpu`` DP only; reduce-     DSP ranks never      partition over DP x DSP
       scatter / partition size                     reduced: drift       (``partition_for_zero3``)
3      ... once partitioned over DP x DSP:          mean DSP, mean DP    x DSP on every local grad
       reduce_scatter_coalesced / seq_dp
=====  ===========================================  ===================  ==========================

ZeRO-3's reduce-scatter ignores ``sequence_parallel_size``, so each local
gradient is multiplied by the DSP size before DeepSpeed sees it. A tensor hook
on each parameter runs before autograd accumulates into ``.grad`` and so
before ZeRO's post-accumulate reduction hook, on every micro-batch and in
every precision, for one elementwise multiply per parameter per backward.
(Scaling the loss would do the same but needs a patched ``engine.backward``.)
``tests/test_deepspeed_convention.py`` pins every stage against a
single-process run and fails if DeepSpeed changes any row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from dsp_plugin.deepspeed.config import DSPSettings

if TYPE_CHECKING:
    from dsp_plugin.topology import Topology

__all__ = ["cast_parameters", "fetch_persistent_at_entry", "gradient_scale", "install_every_gradient",
           "install_gradient_scale", "param_dtype", "partition_for_zero3"]


def gradient_scale(settings: DSPSettings) -> float:
    """The factor that turns DeepSpeed's reduction of partial gradients into sum-DSP / mean-DP."""
    if settings.zero_stage == 3:
        return float(settings.size)
    return 1.0


def install_gradient_scale(module: torch.nn.Module, scale: float) -> list[RemovableHandle]:
    """Multiply every trainable parameter's incoming gradient by ``scale`` (replacing earlier ones).

    Tensor hooks always run before ZeRO's post-accumulate-grad hooks, whatever
    the registration order. Calling this again on the same module (a second
    ``initialize``) replaces the hooks instead of stacking them; scale 1 removes them.
    """
    for handle in getattr(module, "_dsp_gradient_scale_hooks", []):
        handle.remove()
    handles = []
    if scale != 1.0:
        for param in module.parameters():
            if param.requires_grad:
                handles.append(param.register_hook(lambda grad, s=scale: grad * s))
    module._dsp_gradient_scale_hooks = handles
    return handles


def install_every_gradient(module: torch.nn.Module, group: dist.ProcessGroup | None) -> list[RemovableHandle]:
    """Give every trainable parameter a gradient on every rank of ``group``, zero where this rank did not use it.

    A parameter used on some ranks only (a CLS or register token added to the
    frame one rank holds, a head computed on one rank's shard, an adapter reading
    ``emb.cls_token`` as an attribute) has no gradient on the others; ZeRO's
    buckets then hold different parameters on different ranks and the reduction
    flattens different sizes (gloo aborts: "Received data size doesn't match
    expected size"). ``dsp_plugin.every_gradient`` learns in the first forward which
    parameters the ranks of ``group`` (DP x DSP: ZeRO's) use unalike and hangs their
    zero terms on the model's input, so their gradients complete at the same point of
    every rank's backward and ZeRO fills its buckets in the same order everywhere; a
    parameter no rank used gets zeros too (ZeRO-2 fails on a missing one).
    Installed after ``deepspeed.initialize`` (replacing what ``parallelize`` installed
    on the same model or a submodule).
    """
    from dsp_plugin import every_gradient

    return every_gradient.install(module, group=group, unused=True)


def fetch_persistent_at_entry(module: torch.nn.Module) -> None:
    """ZeRO-3: fetch the persistent (small) parameters in the model's own pre-forward, on every rank.

    DeepSpeed otherwise gathers a parameter when its module runs, or, read as an attribute outside
    its module's forward (an adapter adding ``emb.cls_token`` to the frame one rank holds), when it
    is read: on the reading ranks only, which then wait in an all_gather their peers never call
    (gloo aborts). Registered as external parameters of the model itself (DeepSpeed's own
    ``register_external_parameter``), the small ones are gathered at the model's entry on every
    rank alike; being persistent they stay gathered, so this costs one gather in the first forward.
    A large (partitioned) parameter read on some ranks only still needs the user's registration.
    """
    from deepspeed.runtime.zero import register_external_parameter

    for param in module.parameters():
        if getattr(param, "ds_persist", False):
            register_external_parameter(module, param)


def partition_for_zero3(module: torch.nn.Module, topology: Topology, config: dict[str, Any], mpu: Any) -> None:
    """Make ZeRO-3 partition (and so reduce-scatter) every parameter over DP x DSP.

    ``deepspeed.initialize`` converts a plain module with
    ``zero.Init(data_parallel_group=mpu.get_data_parallel_group())``: the DP group
    only, so the reduce-scatter never crosses the DSP ranks and their partial
    gradients are never summed (measured: each DSP rank steps with its own
    shard's gradient and the replicas drift apart). Converting the module first
    over the DP x DSP group, as ``zero.Init`` would by default on the world when
    tp = pp = 1, puts the gradients where the reduction can see them;
    DeepSpeed then skips its own conversion. A module already built under
    ``zero.Init`` must have been partitioned over the same ranks.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    expected = dist.get_world_size(topology.dp_dsp_group)
    dtype = param_dtype(config)
    for name, param in module.named_parameters():
        if not is_zero_param(param):
            continue
        if dist.get_world_size(param.ds_process_group) != expected:
            raise ValueError(f"ZeRO-3 with DSP: parameter {name!r} is partitioned over "
                             f"{dist.get_world_size(param.ds_process_group)} ranks; expected DP x DSP = {expected} "
                             f"(build the model under deepspeed.zero.Init() without data_parallel_group)")
        if dtype is not None and param.is_floating_point() and param.dtype != dtype:
            raise ValueError(f"ZeRO-3 with DSP: parameter {name!r} was built under zero.Init as {param.dtype}, but "
                             f"the config trains in {dtype} (DeepSpeed does not cast zero.Init models); build it "
                             f"under deepspeed.zero.Init(config_dict_or_path=config) with the same config")
    if not all(is_zero_param(p) for p in module.parameters()):
        cast_parameters(module, dtype)
        deepspeed.zero.Init(module=module, data_parallel_group=topology.dp_dsp_group, config_dict_or_path=config,
                            mpu=mpu)


def param_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed trains the module's parameters in: fp16, bf16, or None (fp32), read by its own parsers."""
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    if get_float16_config(config).enabled:
        return torch.half
    if get_bfloat16_config(config).enabled:
        return torch.bfloat16
    return None


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Cast floating-point parameters to ``dtype`` (buffers untouched), as ``deepspeed.initialize`` does.

    DeepSpeed casts a plain module's parameters in ``_configure_distributed_model``
    but skips that cast for a module already converted by ``zero.Init``, trusting
    ``zero.Init``'s tensor-constructor override to have built them in the
    configured dtype. ``zero.Init(module=...)`` converts an existing module
    without that override, so without this cast a bf16/fp16 ZeRO-3 run keeps
    fp32 parameters and the first half-precision input fails. Buffers are left
    to the engine, which treats them the same for both kinds of module.
    """
    if dtype is None:
        return
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
