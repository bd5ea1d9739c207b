"""``Heads(qkv=..., out=...)``: the head switch for attention a module computes itself, per head.

Some attention is no kernel call either level of ``plan.attention`` sees: SanaVideo's
linear attention is ``relu`` features and two matmuls written out in its processor.
It is still per head, with sums over every token, so q, k, v on the head shard (every
token, this rank's heads) give the one-process result. The plan names where q, k and v
are whole per token (the outputs ``[B, L_local, H*C]`` of three submodules, after any
norm across heads) and where the output returns (the input of one more):

    "blocks.*.attn1": Heads(qkv=("norm_q", "norm_k", "to_v"), out="to_out.0")

Forward hooks on those three switch each output ``S(L) -> S(heads)`` (one all-to-all
each, ``[B, L, h*C]``), a pre-hook on ``out`` switches its input back (one more), and
for the call the module's ``heads`` reads this rank's count ``h``, so the processor's
``unflatten(2, (attn.heads, -1))`` groups this rank's heads; a kernel it calls on them
(AnyFlow FAR's flex attention after its own masking) is not switched again. A rank holding no head
(more ranks than heads) computes one head of zeros, still in the autograd graph, whose
output it drops: its collectives meet its peers' in forward and backward. Under
activation checkpointing each switch is replayed from the forward
(``plan.recompute``), as the kernel-level switches are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsp_plugin.comm import chunk_sizes
from dsp_plugin.head_switch.exchange import _Exchange, _FromHeads, _ToHeads, head_ranges
from dsp_plugin.plan import recompute
from dsp_plugin.plan.attention import current_call
from dsp_plugin.plan.spec import Heads

__all__ = ["install"]

_HEADS = ("heads", "num_heads")


def install(path: str, module: nn.Module, spec: Heads) -> list[Any]:
    """Register the switches of ``spec`` (a ``Heads`` with ``qkv``) on ``module``'s submodules; return the
    handles (``remove_plan`` removes them)."""
    assert spec.qkv is not None and spec.out is not None
    attr = next((a for a in _HEADS if isinstance(getattr(module, a, None), int)), None)
    if attr is None:
        raise ValueError(f"parallelize: {path}: Heads(qkv=...) needs the module's head count as an int attribute "
                         f"'heads' or 'num_heads' (its processor groups the channels by it); {type(module).__name__} "
                         f"has neither")
    subs = []
    for name in (*spec.qkv, spec.out):
        try:
            subs.append(module.get_submodule(name))
        except AttributeError:
            raise ValueError(f"parallelize: {path}: Heads(qkv={spec.qkv!r}, out={spec.out!r}): {type(module).__name__} "
                             f"has no submodule {name!r}") from None
    heads = _HeadCount(module, attr)
    handles = [sub.register_forward_hook(_ToHeadShard(path, kind, heads))
               for kind, sub in zip(("q", "k", "v"), subs[:3])]
    handles.append(subs[3].register_forward_pre_hook(_FromHeadShard(path, heads)))
    handles.append(module.register_forward_hook(heads.restore_hook, always_call=True))
    return handles


class _HeadCount:
    """The module's head count: the whole one, and this rank's while a call runs on the head shard."""

    def __init__(self, module: nn.Module, attr: str) -> None:
        self.module, self.attr, self.whole = module, attr, getattr(module, attr)

    def set_local(self, count: int) -> None:
        setattr(self.module, self.attr, max(count, 1))  # a rank with no head computes one of zeros

    def restore(self) -> None:
        setattr(self.module, self.attr, self.whole)

    def restore_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.restore()


def _exchange(call: Any, heads: int) -> tuple[_Exchange, int]:
    """The switch of one tensor ``[B, *local lengths, H, C]`` for the open ``Heads`` call, and this rank's heads."""
    width, axis = len(call.switch_local), call.switch_axis
    ranges = tuple(head_ranges(heads, call.n))
    ex = _Exchange(1 + axis, 1 + width, tuple(chunk_sizes(call.switch_full[axis], call.n)), (ranges,), (heads,),
                   call.group, call.n, call.rank)
    return ex, ranges[call.rank][1]


class _ToHeadShard:
    """Forward hook of a q / k / v submodule: its output ``[B, L_local, H*C] -> [B, L, h*C]``."""

    def __init__(self, path: str, kind: str, heads: _HeadCount) -> None:
        self.path, self.kind, self.heads = path, kind, heads

    def __call__(self, sub: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        call = current_call()
        if call is None or call.where != self.path or call.n == 1:
            return output
        whole = self.heads.whole
        ex, mine = _exchange(call, whole)
        x = output.unflatten(-1, (whole, -1))                     # [B, L_local, H, C]
        if len(call.switch_local) > 1:
            x = x.unflatten(1, call.switch_local)                 # [B, *local, H, C]
        y = recompute.replay((self.path, f"to_heads_{self.kind}"), lambda t: _ToHeads.apply(ex, t)[0], x)
        y = y.flatten(1, len(call.switch_local)).flatten(-2)      # [B, L, h*C]
        self.heads.set_local(mine)
        call.in_kernel = True  # a kernel the processor calls on the head shard is not switched again
        if mine == 0:  # one head of zeros, in the graph (its gradient, zero, meets the peers' backward)
            return y.new_zeros(*y.shape[:-1], output.shape[-1] // whole) + y.sum() * 0
        return y


class _FromHeadShard:
    """Forward pre-hook of the ``out`` submodule: its input ``[B, L, h*C] -> [B, L_local, H*C]``."""

    def __init__(self, path: str, heads: _HeadCount) -> None:
        self.path, self.heads = path, heads

    def __call__(self, sub: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        call = current_call()
        if call is None or call.where != self.path or call.n == 1:
            return None
        whole = self.heads.whole
        self.heads.restore()
        call.in_kernel = False
        ex, mine = _exchange(call, whole)
        x = args[0]
        channels = x.shape[-1] if mine else 0
        x = x.narrow(-1, 0, channels).unflatten(-1, (mine, -1) if mine else (0, x.shape[-1]))  # [B, L, h, C]
        if len(call.switch_local) > 1:
            x = x.unflatten(1, call.switch_full)                  # [B, *full, h, C]
        y = recompute.replay((self.path, "from_heads"), lambda t: _FromHeads.apply(ex, t)[0], x)
        call.attended += 1
        return (y.flatten(1, len(call.switch_local)).flatten(-2), *args[1:])
