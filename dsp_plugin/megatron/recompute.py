"""Full recompute without replaying the DSP switch.

``TransformerBlock``'s full recompute runs each checkpointed chunk twice: once
under ``no_grad`` (keeping only the chunk input) and again inside backward. A
DSP layer's switch sits at the start of the layer, so the second run would issue
its all-to-all again. :class:`SwitchReplayCache` keeps the switch output of the
first run, keyed by the chunk input (which the checkpoint keeps alive anyway),
and the recompute reuses it through :class:`_ReusedSwitch`, whose backward is the
inverse switch, the same all-to-all the plain switch would issue in backward.
Cost: one extra activation of the size of the chunk input per checkpointed layer.

A layer uses the cache only when it is the first layer of a checkpointed chunk
(its input is then the checkpoint's input): ``recompute_method="uniform"`` with
``local_index % recompute_num_layers == 0``, or ``"block"`` with
``local_index < recompute_num_layers``. A hit needs the same storage, offset,
shape and version counter as the first run, and the entry holds a reference to
that input, so storage cannot be reused by another tensor while it waits: a hit
is always the switch of the same data. Entries are consumed by the recompute.
With ``distribute_saved_activations`` (the checkpoint splits and re-gathers its
input) the cache is off and the switch is replayed.

The same entry keeps the chunk input's *Python object* alive until the
recompute, for every first layer of a chunk (switching or not): the checkpoint
saves only the tensor data and recomputes on a detached copy, and the copy finds
the input's :class:`~dsp_plugin.layout.ShardSpec` (the global frames and
patches) through the live original (``layout.shard_spec``'s alias lookup).
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.comm import dynamic_switch

__all__ = ["SwitchReplayCache", "first_layer_of_a_chunk"]

_MAX_PENDING = 32  # micro-batches waiting for their recompute (at most the PP size with 1F1B); older dropped


def first_layer_of_a_chunk(config: Any, local_index: int) -> bool:
    """Whether the layer at ``local_index`` (0-based within its stage) starts a full-recompute chunk."""
    if config.recompute_granularity != "full" or not config.recompute_num_layers:
        return False
    if config.distribute_saved_activations:  # the checkpoint re-stores its input: no key would match
        return False
    if config.recompute_method == "uniform":
        return local_index % config.recompute_num_layers == 0
    if config.recompute_method == "block":
        return local_index < config.recompute_num_layers
    return False


class _ReusedSwitch(torch.autograd.Function):
    """Forward: the switch output of the first run; backward: the inverse switch of the gradient."""

    @staticmethod
    def forward(ctx, x, switched, cur, tgt, group, tgt_full):  # type: ignore[override]
        ctx.switch = (cur, tgt, group, tgt_full)
        return switched.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cur, tgt, group, tgt_full = ctx.switch
        # S(tgt) -> S(cur): one all-to-all, what dynamic_switch's own backward does
        return dynamic_switch(grad.contiguous(), tgt, cur, group=group, global_len=tgt_full), \
            None, None, None, None, None


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t._version)


class SwitchReplayCache:
    """Per-layer cache of switch outputs between a checkpoint's first run and its recompute."""

    def __init__(self) -> None:
        self._pending: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def hold(self, chunk_input: torch.Tensor) -> None:
        """First run of a checkpointed chunk (no grad): keep the tagged input alive for its recompute."""
        if torch.is_grad_enabled():
            return
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[_key(chunk_input)] = (chunk_input, None)

    def release(self, chunk_input: torch.Tensor) -> None:
        """The recompute of a layer that does not switch: drop its entry."""
        if torch.is_grad_enabled():
            self._pending.pop(_key(chunk_input), None)

    def switch(self, chunk_input: torch.Tensor, x: torch.Tensor, cur: int, tgt: int, *, group: Any,
               cur_full: int, tgt_full: int) -> torch.Tensor:
        """``dynamic_switch(x, cur, tgt)``, issued once per micro-batch under full recompute."""
        if not torch.is_grad_enabled():  # first run of a checkpointed chunk: keep the result
            out = dynamic_switch(x, cur, tgt, group=group, global_len=cur_full)
            self.hold(chunk_input)
            self._pending[_key(chunk_input)] = (chunk_input, out)
            return out
        entry = self._pending.pop(_key(chunk_input), None)
        if entry is None or entry[1] is None:  # not a recompute of a kept run: switch as usual
            return dynamic_switch(x, cur, tgt, group=group, global_len=cur_full)
        return _ReusedSwitch.apply(x, entry[1], cur, tgt, group, tgt_full)
