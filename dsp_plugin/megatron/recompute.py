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
``local_index < recompute_num_layers``. The entry holds the chunk input itself, the
very tensor object the checkpoint saves and recomputes from; the recompute runs on a
detached copy of it, so a hit is the entry whose input has, *now*, the same storage,
offset, shape and version counter as the recompute's input: the same tensor. Comparing
at lookup time (not keys taken at the first run) keeps this true under
``--distribute-saved-activations``, where Megatron's checkpoint splits its input over
TP after the first run and re-gathers it before the recompute into a new buffer, under
the same tensor object. Entries are consumed by the recompute. Under
``--distribute-saved-activations`` the cache keeps no switch output (``keep_outputs=False``):
the user asked to save activation memory, so the recompute replays the switch (one
all-to-all more per chunk in backward) and the entry only keeps the input's tag reachable
(the held input holds 1/TP of its data between the two runs).

The same entry keeps the chunk input's *Python object* alive until the
recompute, for every first layer of a chunk (switching or not): the checkpoint
saves only the tensor data and recomputes on a detached copy, and the copy finds
the input's :class:`~dsp_plugin.layout.ShardSpec` (the global frames and
patches) through the live original (``layout.shard_spec``'s alias lookup), or,
once Megatron re-gathered it into new memory, through :meth:`SwitchReplayCache.original`.
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.comm import dynamic_switch
from dsp_plugin.comm.payload import as_payload
from dsp_plugin.layout import storage_address

__all__ = ["SwitchReplayCache", "first_layer_of_a_chunk"]

_MAX_PENDING = 32  # micro-batches waiting for their recompute (at most the PP size with 1F1B); older dropped


def first_layer_of_a_chunk(config: Any, local_index: int) -> bool:
    """Whether the layer at ``local_index`` (0-based within its stage) starts a full-recompute chunk."""
    if config.recompute_granularity != "full" or not config.recompute_num_layers:
        return False
    if config.recompute_method == "uniform":
        return local_index % config.recompute_num_layers == 0
    if config.recompute_method == "block":
        return local_index < config.recompute_num_layers
    return False


class _ReusedSwitch(torch.autograd.Function):
    """Forward: the switch output of the first run; backward: the inverse switch of the gradient."""

    @staticmethod
    def forward(ctx, x, switched, cur, tgt, group, tgt_full, wire):  # type: ignore[override]
        ctx.switch = (cur, tgt, group, tgt_full, wire)
        return switched.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cur, tgt, group, tgt_full, wire = ctx.switch
        # S(tgt) -> S(cur): one all-to-all, what dynamic_switch's own backward does (the gradient in the
        # payload's gradient format: the reversed payload's forward)
        back = None if wire is None else wire.reversed()
        return dynamic_switch(grad.contiguous(), tgt, cur, group=group, global_len=tgt_full, comm_dtype=back), \
            None, None, None, None, None, None


def _key(t: torch.Tensor) -> tuple:
    return (storage_address(t), t.storage_offset(), tuple(t.shape), t._version)


class SwitchReplayCache:
    """Per-layer cache of chunk inputs and switch outputs between a checkpoint's first run and its recompute."""

    def __init__(self, *, keep_outputs: bool = True) -> None:
        self.keep_outputs = keep_outputs
        self._pending: list[list[Any]] = []  # [chunk input, its switch output or None], oldest first

    def _find(self, x: torch.Tensor) -> int | None:
        key = _key(x)  # each held input's memory as it is now (Megatron may have re-gathered it)
        return next((i for i, (held, _) in enumerate(self._pending) if _key(held) == key), None)

    def hold(self, chunk_input: torch.Tensor) -> None:
        """First run of a checkpointed chunk (no grad): keep the tagged input alive for its recompute."""
        if torch.is_grad_enabled() or self._find(chunk_input) is not None:
            return
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(0)
        self._pending.append([chunk_input, None])

    def original(self, x: torch.Tensor) -> torch.Tensor | None:
        """The recompute: the kept chunk input that ``x`` is a detached copy of (the tagged object), or None."""
        if not torch.is_grad_enabled() or not self._pending:
            return None
        index = self._find(x)
        return None if index is None else self._pending[index][0]

    def release(self, chunk_input: torch.Tensor) -> None:
        """The recompute of a layer that does not switch: drop its entry."""
        if torch.is_grad_enabled() and (index := self._find(chunk_input)) is not None:
            self._pending.pop(index)

    def switch(self, chunk_input: torch.Tensor, x: torch.Tensor, cur: int, tgt: int, *, group: Any,
               cur_full: int, tgt_full: int, comm_dtype: object = None) -> torch.Tensor:
        """``dynamic_switch(x, cur, tgt)``, issued once per micro-batch under full recompute."""
        wire = as_payload("SwitchReplayCache.switch", comm_dtype)
        if not torch.is_grad_enabled():  # first run of a checkpointed chunk: keep the result
            out = dynamic_switch(x, cur, tgt, group=group, global_len=cur_full, comm_dtype=wire)
            self.hold(chunk_input)
            index = self._find(chunk_input)
            if index is not None and self.keep_outputs:
                self._pending[index][1] = out
            return out
        index = self._find(chunk_input)
        entry = None if index is None else self._pending.pop(index)
        if entry is None or entry[1] is None:  # not a recompute of a kept run: switch as usual
            return dynamic_switch(x, cur, tgt, group=group, global_len=cur_full, comm_dtype=wire)
        return _ReusedSwitch.apply(x, entry[1], cur, tgt, group, tgt_full, wire)
