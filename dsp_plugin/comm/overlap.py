"""``switch_apply``: the switch of one batch chunk in flight while the previous chunk computes."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dsp_plugin import layout
from dsp_plugin.comm.agree import _as_int, _normalize_dim
from dsp_plugin.comm.collectives import all_to_all_single
from dsp_plugin.comm.primitives import _prepare_switch, _SwitchBuffers
from dsp_plugin.packing import chunk_sizes, join_blocks, split_blocks

__all__ = ["switch_apply"]


class _SwitchStart(torch.autograd.Function):
    """Pack and launch the all-to-all; returns the receive buffer, filled once ``_SwitchFinish`` waits."""

    @staticmethod
    def forward(ctx, x, cur, tgt, cur_full, group, n, rank, pending):  # type: ignore[override]
        plan = _SwitchBuffers(x, cur, tgt, cur_full, n, rank)
        work = all_to_all_single(plan.recv, plan.send, recv_splits=plan.recv_splits,
                                 send_splits=plan.send_splits, group=group, async_op=True)
        pending.update(work=work, plan=plan)
        ctx.group, ctx.n, ctx.tgt = group, n, tgt
        ctx.splits = (plan.send_splits, plan.recv_splits)
        ctx.x_shape = list(x.shape)
        return plan.recv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_recv):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        # the forward's exchange reversed: block i goes back to rank i, block j comes from rank j
        grad_send = grad_recv.new_empty(math.prod(ctx.x_shape))
        all_to_all_single(grad_send, grad_recv.contiguous(), recv_splits=send_splits, send_splits=recv_splits,
                          group=ctx.group)
        tgt_sizes = chunk_sizes(ctx.x_shape[ctx.tgt], ctx.n)
        return join_blocks(grad_send, ctx.x_shape, ctx.tgt, tgt_sizes), None, None, None, None, None, None, None


class _SwitchFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, cur, n, pending):  # type: ignore[override]
        pending.pop("work").wait()
        plan = pending.pop("plan")          # its send buffer may be freed from here on
        ctx.cur, ctx.n = cur, n
        return join_blocks(recv, plan.block_shape, cur, plan.cur_sizes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        return split_blocks(grad, ctx.cur, ctx.n)[0], None, None, None


def switch_apply(x: torch.Tensor, fn, cur_shard: int, tgt_shard: int, *, chunks: int = 2,  # noqa: ANN001
                 chunk_dim: int = 0, group: dist.ProcessGroup | None = None,
                 global_len: int | None = None) -> torch.Tensor:
    """``fn(dynamic_switch(x, cur_shard, tgt_shard))``, with communication hidden behind computation.

    ``x`` is cut into ``chunks`` along ``chunk_dim`` (a batch dim: neither shard
    dim). The all-to-all of chunk ``i + 1`` is in flight (``async_op``) while
    ``fn`` runs on chunk ``i``; the results are concatenated along ``chunk_dim``.
    Same bytes and one collective per chunk; ``fn`` must treat chunks
    independently (a transformer block does: it never mixes samples). Backward
    is correct but not overlapped, and not differentiable twice (use
    ``dynamic_switch`` for a gradient penalty).
    """
    def options(x: torch.Tensor) -> int:
        batch = _normalize_dim("switch_apply", "chunk_dim", chunk_dim, x.dim())
        if _as_int("switch_apply", "chunks", chunks) < 1:
            raise ValueError(f"switch_apply: chunks={chunks}; expected a positive int")
        if batch in (_normalize_dim("switch_apply", "cur_shard", cur_shard, x.dim()),
                     _normalize_dim("switch_apply", "tgt_shard", tgt_shard, x.dim())):
            raise ValueError(f"switch_apply: chunk_dim={chunk_dim} is one of the shard dims "
                             f"({cur_shard}, {tgt_shard}); expected a batch dim")
        return batch

    call = _prepare_switch("switch_apply", x, cur_shard, tgt_shard, group, global_len, options)
    if call is None:
        return fn(x)
    cur, tgt, cur_full, group, n, rank, batch = call
    pieces = [p for p in x.tensor_split(chunks, dim=batch) if p.shape[batch] > 0]

    def start(piece: torch.Tensor) -> tuple[torch.Tensor, dict]:
        pending: dict = {}
        return _SwitchStart.apply(piece, cur, tgt, cur_full, group, n, rank, pending), pending

    outputs, in_flight = [], start(pieces[0])
    for i in range(len(pieces)):
        following = start(pieces[i + 1]) if i + 1 < len(pieces) else None
        recv, pending = in_flight
        outputs.append(fn(_SwitchFinish.apply(recv, cur, n, pending)))
        in_flight = following  # type: ignore[assignment]
    out = torch.cat(outputs, dim=batch)
    return layout.attach(out, tgt, x.shape[tgt]) if out.dim() == x.dim() else out
