"""``replicate_grad``: the full gradient of a replicated input on every rank of the group.

Under ``dsp_plugin.parallelize`` the gradient of a *replicated* input (latents before the
plan's split, timesteps, text embeddings) is **partial** over the DSP group, like a parameter's
gradient before its reduction: each rank holds its own tokens' contribution and the sum over
the group is the one-process gradient. That costs no collective, and a loss on the model's
output (the usual case) needs nothing more. Where the input gradient itself is used (a gradient
penalty on the input, trained text embeddings), pass the input through ``replicate_grad``:

    x = replicate_grad(x, group=g)                       # identity forward
    out = model(x, t, text)                              # x.grad / autograd.grad(.., x): the sum over g

Forward is the identity (no communication); backward is one all_reduce (sum) over the group,
itself differentiable, so ``create_graph=True`` and a second backward work: the summed gradient
is a replicated result, counted once like the model's own replicated outputs (a penalty every
rank computes from it gets 1/N of its gradient on each rank), so a gradient penalty summed over
the group by ``reduce_gradients`` trains like one process. The primitives' own convention differs:
``split``'s backward gathers, so an input given to ``split`` already has the full gradient on every
rank (docs/concepts.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.comm.agree import _agree
from dsp_plugin.comm.collectives import all_reduce_sum
from dsp_plugin.comm.group_resolution import _member

__all__ = ["replicate_grad"]


def _reduce(x: torch.Tensor, group: dist.ProcessGroup, n: int, rank: int, *, mean: bool) -> torch.Tensor:
    _agree("replicate_grad", x, cur=-1, tgt=-1, known_len=None, group=group, n=n, rank=rank, error=None)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    all_reduce_sum(out, group=group)
    return out.div_(n) if mean else out


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group`` (one all_reduce), a result every rank holds alike.

    Backward: the mean over ``group``. The sum is a replicated result, and the project counts a
    replicated result once (the model's replicated outputs get 1/N of their gradient, ``plan.ops``):
    every rank computes the same penalty from it, so the exact adjoint (a sum) divided by N. Where
    the ranks' incoming gradients are alike (the same penalty on every rank) that is the identity.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, n: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.n, ctx.rank = group, n, rank
        return _reduce(x, group, n, rank, mean=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _MeanOverGroup.apply(grad, ctx.group, ctx.n, ctx.rank), None, None, None


class _MeanOverGroup(torch.autograd.Function):
    """The mean over ``group`` (one all_reduce); its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, n: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.n, ctx.rank = group, n, rank
        return _reduce(x, group, n, rank, mean=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _MeanOverGroup.apply(grad, ctx.group, ctx.n, ctx.rank), None, None, None


class _ReplicateGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, n: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.n, ctx.rank = group, n, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _SumOverGroup.apply(grad, ctx.group, ctx.n, ctx.rank), None, None, None


def replicate_grad(x: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` unchanged; its gradient becomes the sum over ``group`` (None: the DSP group of the topology).

    For a replicated input of a ``parallelize``d model whose gradient is used itself (module docstring).
    The ranks compare the gradient's shape and dtype before the all_reduce (``dsp_plugin.checks``). A
    size-1 group returns ``x``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"replicate_grad: expected a torch.Tensor, got {type(x).__name__}")
    group, n, rank = _member("replicate_grad", group)
    return x if n == 1 else _ReplicateGrad.apply(x, group, n, rank)
