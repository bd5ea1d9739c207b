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
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from dsp_plugin.deepspeed.config import DSPSettings

if TYPE_CHECKING:
    from dsp_plugin.topology import Topology

__all__ = ["cast_parameters", "gradient_scale", "install_every_gradient", "install_gradient_scale", "param_dtype",
           "partition_for_zero3"]


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


def install_every_gradient(module: torch.nn.Module) -> list[RemovableHandle]:
    """Give every trainable parameter a gradient on every rank, zero where this rank did not use it.

    A parameter used on some ranks only (a CLS or register token added to the
    frame one rank holds, a head computed on one rank's shard) has no gradient on
    the others; ZeRO's buckets then hold different parameters on different ranks
    and the reduction flattens different sizes (gloo aborts: "Received data size
    doesn't match expected size"). A forward pre-hook on every module that owns
    parameters passes the module's first floating-point input through ``_Touch``
    (an identity view whose backward also returns a zero gradient for each of the
    module's parameters), so autograd delivers a gradient to every parameter on
    every rank, zero where the rank did not use it, and DeepSpeed's own hooks
    reduce the same parameters everywhere: a missing gradient counts as zeros, as
    on one process.

    On the input, not the output: the last contribution to a parameter's
    gradient then arrives when the backward leaves its module, on every rank
    alike, so ZeRO-2/3 fill their buckets in the same order everywhere (with the
    term on the output, a rank that never used the token had its gradient ready
    first and the reduce-scatter summed mismatched slots). Install after
    ``deepspeed.initialize``: ZeRO-3 gathers a module's parameters in its own
    pre-hook, which must run first. A module whose inputs hold no floating-point
    tensor gets it on its output. Cost: one autograd node per module call, and
    per backward one zero-filled tensor (and its accumulation) per parameter.
    """
    for handle in getattr(module, "_dsp_every_gradient_hooks", []):
        handle.remove()
    handles = []
    for owner in module.modules():
        params = [p for p in owner.parameters(recurse=False) if p.requires_grad]
        if params:
            handles.extend(_zero_term_hooks(owner, params))
    module._dsp_every_gradient_hooks = handles
    return handles


class _Touch(torch.autograd.Function):
    """Identity on ``x`` (a view, no copy) whose backward also hands each of ``params`` a zero gradient."""

    @staticmethod
    def forward(ctx, x, *params):  # type: ignore[override]
        # the shapes now: ZeRO-3 releases a parameter's storage after its module's forward
        ctx.specs = [(p.shape, p.dtype, p.device) for p in params]
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs))


def _add_zero_term(tree: Any, params: list[torch.nn.Parameter]) -> tuple[Any, bool]:
    leaves, spec = tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            leaves[i] = _Touch.apply(leaf, *params)
            return tree_unflatten(leaves, spec), True
    return tree, False


def _zero_term_hooks(owner: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[RemovableHandle]:
    state = {"on_output": False}   # a module whose inputs hold no floating-point tensor: its output, from then on

    def before(_: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if state["on_output"] or not torch.is_grad_enabled():
            return None
        (args, kwargs), added = _add_zero_term((args, kwargs), params)
        if added:
            return args, kwargs
        state["on_output"] = True
        handles.append(owner.register_forward_hook(after))
        return None

    def after(_: torch.nn.Module, args: Any, output: Any) -> Any:
        return _add_zero_term(output, params)[0] if torch.is_grad_enabled() else None

    handles = [owner.register_forward_pre_hook(before, with_kwargs=True)]
    return handles


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
