"""``Heads``: a module's full attention runs on the head shard, through the head switch.

Inside a ``Heads`` module, every ``torch.nn.functional.scaled_dot_product_attention``
call (the one the model's own attention code makes, whatever its processor) is
intercepted by a ``TorchFunctionMode`` that lives only for that module's call:
q, k, v ``[B, H, L_local, Dh]`` sharded on the sequence become ``[B, H_local, L, Dh]``
(``dsp_plugin.head_switch.to_heads``: one packed all-to-all), attention runs locally on
the full sequence, and the output goes back to the sequence shard
(``from_heads``: one more). Attention outside ``Heads`` modules (text
cross-attention) is untouched: local, no communication.

With ``Heads(joint=...)`` the call holds ``R`` replicated tokens beside this
rank's ``L_local`` (text in joint attention, at the front or the back): their
q, k, v are narrowed to this rank's heads (no communication), the attention runs
on ``[B, H_local, R + L, Dh]``, and their output comes back with every head,
replicated, inside ``from_heads``' all-to-all (each rank's heads of it sent to
every rank; backward sums the ranks' gradients). Packing it there instead of a
separate all_gather over heads saves a collective each way and the all_gather's
padding of uneven head chunks (``tests/test_plan_joint.py`` measures both).

The global ``L`` is read from the enclosing ``Block``'s placement. Modes are
per thread, so two threads may run the model at once.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dsp_plugin.comm import chunk_sizes, group_rank, group_size
from dsp_plugin.plan import recompute

__all__ = ["enter_heads", "exit_heads"]

_local = threading.local()
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _HeadSwitchMode(TorchFunctionMode):
    def __init__(self, where: str, lengths: list[tuple[int, int]], axis: int, group: Any,
                 joint: str | None = None) -> None:
        super().__init__()
        # the sequence dim may fold several axes (Wan's F*H*W tokens sharded on F): (local, global) length
        # of each, and which one is sharded; the switch runs on that axis of the unfolded view
        self.where, self.lengths, self.axis, self.group, self.joint = where, lengths, axis, group, joint

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA, args)) | kwargs
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        mask = call.get("attn_mask")
        if mask is not None and mask.dim() >= 2 and (mask.shape[-2] != 1 or (mask.dim() >= 3 and mask.shape[-3] != 1)):
            raise ValueError(f"{self.where}: Heads attention takes no mask over queries or heads (got a mask of "
                             f"shape {tuple(mask.shape)}); expected None or a key-only mask [.., 1, 1, L]")
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"{self.where}: Heads is for self-attention; got {q.shape[-2]} queries and "
                             f"{k.shape[-2]} keys on this rank (leave cross-attention out of Heads)")
        if self.joint is not None:
            if mask is not None:
                raise ValueError(f"{self.where}: Heads(joint={self.joint!r}) takes no attention mask (got one of "
                                 f"shape {tuple(mask.shape)}); expected None")
            return self._joint(func, q, k, v, call)
        from dsp_plugin.head_switch import from_heads, to_heads

        heads, local, full = q.shape[1], [a for a, _ in self.lengths], [b for _, b in self.lengths]
        seq, width = 2 + self.axis, len(self.lengths)
        if q.shape[2] != math.prod(local):
            raise ValueError(f"{self.where}: the attention holds {q.shape[2]} tokens, this rank's shard of the "
                             f"sequence {full} is {math.prod(local)}; if the module joins tokens every rank holds "
                             f"whole (text in joint attention), say where: Heads(joint='first' or 'last')")
        q, k, v = (t.unflatten(2, local) for t in (q, k, v))
        q, k, v = recompute.replay((self.where, "to_heads"), lambda *qkv: to_heads(  # GQA: not kept (recompute.py)
            *qkv, seq_dim=seq, head_dim=1, group=self.group, global_len=full[self.axis]), q, k, v,
            enabled=k.shape[1] == heads)
        out = func(*(t.flatten(2, 1 + width) for t in (q, k, v)), **call).unflatten(2, full)
        out = recompute.replay((self.where, "from_heads"), lambda o: from_heads(
            o, seq_dim=seq, head_dim=1, group=self.group, global_len=full[self.axis], heads=heads), out)
        return out.flatten(2, 1 + width)

    def _joint(self, func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: dict[str, Any]) -> Any:
        """``[B, H, R + L_local, Dh]`` (R replicated tokens first or last) through the head switch and back."""
        from dsp_plugin.head_switch.exchange import _to_heads, from_heads

        heads, local, full = q.shape[1], [a for a, _ in self.lengths], [b for _, b in self.lengths]
        seq, width, first = 2 + self.axis, len(self.lengths), self.joint == "first"
        mine, total = math.prod(local), math.prod(full)
        count = q.shape[2] - mine
        if count < 0:  # raised on every rank, by to_heads' check before its all-to-all
            error = ValueError(f"{self.where}: Heads(joint={self.joint!r}) expects the replicated tokens plus this "
                               f"rank's {mine} tokens of the sequence {full}, got {q.shape[2]} tokens")
            _to_heads(q, k, v, seq_dim=2, head_dim=1, group=self.group, global_len=None, replicated=None,
                      error=error)
            raise error
        # the replicated tokens as [B, H, 1.., R, 1.., Dh]: R on the sharded axis of the unfolded grid
        whole = [count if i == self.axis else 1 for i in range(width)]
        text_at, own_at = (0, count) if first else (mine, 0)
        text = tuple(t.narrow(2, text_at, count).unflatten(2, whole) for t in (q, k, v))
        own = tuple(t.narrow(2, own_at, mine).unflatten(2, local) for t in (q, k, v))
        q, k, v, q_t, k_t, v_t = recompute.replay((self.where, "to_heads"), lambda *qkv: _to_heads(
            *qkv[:3], seq_dim=seq, head_dim=1, group=self.group, global_len=full[self.axis], replicated=qkv[3:]),
            *own, *text, enabled=k.shape[1] == heads)

        def joined(tokens: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            pair = (text.flatten(2, 1 + width), tokens.flatten(2, 1 + width))
            return torch.cat(pair if first else pair[::-1], dim=2)

        out = func(joined(q, q_t), joined(k, k_t), joined(v, v_t), **call)
        text_at, own_at = (0, count) if first else (total, 0)
        out_t = out.narrow(2, text_at, count).unflatten(2, whole)
        out = out.narrow(2, own_at, total).unflatten(2, full)
        out, out_t = recompute.replay((self.where, "from_heads"), lambda o, o_t: from_heads(
            o, seq_dim=seq, head_dim=1, group=self.group, global_len=full[self.axis], heads=heads, replicated=o_t),
            out, out_t)
        return joined(out, out_t)


def enter_heads(where: str, group: Any, joint: str | None = None) -> None:
    from dsp_plugin.plan.frames import current_block

    block = current_block()
    if block is None:
        raise ValueError(f"{where}: a Heads module must run inside a Block of the plan (its placement gives "
                         f"the global sequence length)")
    grid, shard, lay = block
    names = lay.dims[lay.dim_of(shard)]
    n, rank = group_size(group), group_rank(group)
    lengths = [(chunk_sizes(grid[a], n)[rank] if a == shard else grid[a], grid[a]) for a in names]
    mode = _HeadSwitchMode(where, lengths, names.index(shard), group, joint)
    mode.__enter__()
    if not hasattr(_local, "modes"):
        _local.modes = []
    _local.modes.append(mode)


def exit_heads() -> None:
    modes = getattr(_local, "modes", [])
    if modes:
        modes.pop().__exit__(None, None, None)
