"""``Heads``: a module's full attention runs on the head shard, through the head switch.

Inside a ``Heads`` module the attention is intercepted at two levels, whichever the
model reaches first, never both for one call:

- diffusers' attention dispatch (``dispatch_attention_fn``): every backend of its
  registry (``flash``, ``flex``, ``sage``, ``xformers``, ``_flash_3``, the native
  ones, one a user registers) is wrapped (``dsp_plugin.plan.dispatch``); layout
  ``[B, L, H, Dh]``. While the backend runs, the SDPA level is off (the native
  backends call SDPA themselves);
- ``torch.nn.functional.scaled_dot_product_attention``, for models that call it
  directly, by a ``TorchFunctionMode`` that lives only for the module's call;
  layout ``[B, H, L, Dh]``. It costs a Python call per torch op of the module,
  so it is left off for a module seen attending through diffusers' dispatch
  alone (``plan.runtime``'s ``_learn``).

Both go through one :meth:`HeadsCall.attend`: q, k, v sharded on the sequence
switch to the head shard (``dsp_plugin.head_switch.to_heads``: one packed
all-to-all), the kernel attends over the full sequence with this rank's heads,
and the output switches back (``from_heads``: one more). Attention outside
``Heads`` modules (text cross-attention) is untouched: local, no communication.
A ``Heads`` module whose call ends without any attention intercepted (the model
used a kernel neither level sees) raises, on every rank: its attention saw only
this rank's tokens.

With ``Heads(joint=...)`` the call holds ``R`` replicated tokens beside this
rank's ``L_local`` (text in joint attention, at the front or the back): their
q, k, v are narrowed to this rank's heads (no communication), the attention runs
on ``R + L`` tokens, and their output comes back with every head, replicated,
inside ``from_heads``' all-to-all (each rank's heads of it sent to every rank;
backward sums the ranks' gradients). Packing it there instead of a separate
all_gather over heads saves a collective each way and the all_gather's padding
of uneven head chunks (``tests/test_plan_joint.py`` measures both).

An attention mask is laid out for the attention after the switch
(``dsp_plugin.plan.masks``): built for the global sequence, it is passed on
unchanged (a head dim narrowed to this rank's heads); under ``sharded_io`` a
key-padding mask built from this rank's tokens gets its video key columns
gathered (once per forward per mask object); one the runtime cannot place is
refused on every rank, through ``to_heads``' cross-rank check.

The global ``L`` is read from the enclosing ``Block``'s placement. Calls are per
thread, so two threads may run the model at once. Under activation
checkpointing each attention call of a module call is its own replay key
(``plan.recompute``), so a module that attends several times per forward
(Mochi: once per sample) replays all of them.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dsp_plugin.comm import chunk_sizes, group_rank, group_size
from dsp_plugin.head_switch import exchange
from dsp_plugin.plan import recompute
from dsp_plugin.plan.frames import current_block
from dsp_plugin.plan.masks import (
    check_mask,
    gather_key_padding,
    gather_pairs,
    is_key_padding,
    is_local_pairs,
    place_mask,
)

__all__ = ["HeadsCall", "current_call", "enter_heads", "exit_heads"]

_local = threading.local()
_local.calls = []  # the importing thread's, made now, as plan.frames' (a fresh model's first compiled call)
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# kernel(q, k, v, mask) -> out, on the head shard, in the layout of its inputs
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


class HeadsCall:
    """One call of a ``Heads`` module: the sequence's (local, global) lengths and the attention calls it switched.

    ``lengths``: the axes folded into the attention's sequence dim (Wan's F*H*W
    tokens sharded on F), ``(local, global)`` each; ``axis``: which one is
    sharded. The switch runs on that axis of the unfolded view.
    """

    def __init__(self, where: str, lengths: list[tuple[int, int]], axis: int, group: Any,
                 joint: str | None = None, comm_dtype: object = None, exact: tuple[str, ...] = (),
                 io_masks: dict[int, tuple[Any, Any]] | None = None, *, sdpa: bool = True,
                 members: tuple[int, int] | None = None, fixed: dict[str, Any] | None = None) -> None:
        n, rank = (group_size(group), group_rank(group)) if members is None else members
        if torch.compiler.is_compiling():  # traced once; the lengths may be symbolic (dynamic=True): no cache
            fixed = _fixed(where, lengths, axis, n, rank, joint, comm_dtype, exact)
            for name, value in fixed.items():  # not __dict__.update: torch 2.11's dynamo cannot trace it
                setattr(self, name, value)
        else:  # ``fixed``: the caller's (enter_heads), for this placement
            self.__dict__.update(fixed or _fixed_for(where, lengths, axis, n, rank, joint, comm_dtype, exact))
        self.group = group
        # under sharded_io, sharded on the axis the model is fed shards of: the forward's cache of key-padding
        # masks laid out for the global sequence, by the mask's identity (plan/masks.py); None otherwise
        self.io_masks = io_masks
        self.attended = 0        # attention calls intercepted in this module call (each its own replay key)
        self.via_sdpa = 0        # of them, through the SDPA level (the rest through diffusers' dispatch)
        self.in_kernel = False   # a kernel is running: the SDPA it calls itself is not switched again
        self.sdpa = sdpa         # the SDPA level asked for (enter_heads: off where dispatch is known to serve)
        self.mode: _HeadSwitchMode | None = None  # the SDPA level, while entered (enter_heads)
        self.mode_entered = False  # enter_heads: not under torch.compile

    def attend(self, kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, *, seq: int,
               head: int, error: Exception | None = None) -> torch.Tensor:
        """``kernel`` over the whole sequence with this rank's heads; q, k, v ``[.., R + L_local, .., H, ..]``.

        ``seq`` / ``head``: the sequence and head dims of the layout (SDPA: 2, 1;
        diffusers' dispatch: 1, 2). ``error``: the caller's own refusal, raised on
        every rank through ``to_heads``' check, like every error found here.
        """
        call, self.attended = self.attended, self.attended + 1
        heads, mine, total, axis = q.shape[head], self.mine, self.total, self.switch_axis
        local, full = self.switch_local, self.switch_full
        width, count = len(local), q.shape[seq] - mine
        compiling = torch.compiler.is_compiling()  # traced once, maybe with symbolic shapes: nothing cached
        if self.n > 1 and is_local_pairs(mask, local=count + mine, total=count + total):  # HunyuanVideo 1.5's
            mask = recompute.replay((self.where, "pairs", call), lambda m: gather_pairs(
                self.where, m, lengths=self.lengths, axis=self.axis, count=count, joint=self.joint, group=self.group),
                mask)
        if error is None:
            # a shape seen before without a mask passed the same checks: not checked again
            seen = (q.shape, k.shape, seq, head) if mask is None and not compiling else None
            if seen is None or seen not in self.checked:
                error = self._check(q, k, mask, seq, head, count, total)
                if error is None and seen is not None:
                    self.checked.add(seen)
        if error is not None:  # raised on every rank, by to_heads' check before its all-to-all
            exchange._to_heads(q, k, v, seq_dim=seq, head_dim=head, group=self.group, global_len=None,
                               replicated=None, error=error)
            raise error
        mine_heads = None if compiling else self.heads_of.get(heads)
        if mine_heads is None:
            mine_heads = exchange.head_ranges(heads, self.n)[self.rank]
            if not compiling:
                self.heads_of[heads] = mine_heads
        if width == 1 and not self.joint and mask is None:
            return self._attend_plain(kernel, q, k, v, seq, head, heads, mine_heads, call)
        # the switch runs on the sharded axis of the unfolded sequence: [.., *lengths, ..]
        sharded, head_at = seq + axis, head + (width - 1 if head > seq else 0)
        first = self.joint == "first"
        text_at, own_at = (0, count) if first else (mine, 0)
        own = tuple(_unfolded(t if count == 0 else t.narrow(seq, own_at, mine), seq, local) for t in (q, k, v))
        whole = [count if i == axis else 1 for i in range(width)]  # R tokens on the sharded axis
        text = tuple(t.narrow(seq, text_at, count).unflatten(seq, whole) for t in (q, k, v)) if self.joint else ()
        switched = recompute.replay((self.where, "to_heads", call), lambda *qkv: exchange._to_heads(
            *qkv[:3], seq_dim=sharded, head_dim=head_at, group=self.group, global_len=full[axis],
            replicated=qkv[3:] or None, comm_dtype=self.comm_dtype,
            exact=self.exact_in), *own, *text)
        out_dtype = self.out_dtype

        def joined(tokens: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
            tokens = tokens.flatten(seq, seq + width - 1) if width > 1 else tokens
            if text is None:
                return tokens
            pair = (text.flatten(seq, seq + width - 1), tokens)
            return torch.cat(pair if first else pair[::-1], dim=seq)

        q, k, v = (joined(t, switched[i + 3] if self.joint else None) for i, t in enumerate(switched[:3]))
        if self.io_masks is not None and is_key_padding(mask) and self.n > 1:
            mask = self._io_mask(mask, count)  # every rank, a headless one too: a collective
        if mine_heads[1] == 0:  # more ranks than heads: nothing to attend here (some kernels divide by the heads);
            out = v.clone()     # an empty output still in the graph, so this rank's backward meets its peers'
        else:
            self.in_kernel = True
            try:
                out = kernel(q, k, v, place_mask(mask, heads, mine_heads))
            finally:
                self.in_kernel = False
        own_out = _unfolded(out if count == 0 else out.narrow(seq, count if first else 0, total), seq, full)
        if not self.joint:
            out = recompute.replay((self.where, "from_heads", call), lambda o: exchange.from_heads(
                o, seq_dim=sharded, head_dim=head_at, group=self.group, global_len=full[axis], heads=heads,
                comm_dtype=out_dtype), own_out)
            return out.flatten(seq, seq + width - 1) if width > 1 else out
        text_out = out.narrow(seq, 0 if first else total, count).unflatten(seq, whole)
        out, text_out = recompute.replay((self.where, "from_heads", call), lambda o, o_t: exchange.from_heads(
            o, seq_dim=sharded, head_dim=head_at, group=self.group, global_len=full[axis], heads=heads,
            replicated=o_t, comm_dtype=out_dtype), own_out, text_out)
        return joined(out, text_out)

    def _attend_plain(self, kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int, head: int,
                      heads: int, mine_heads: tuple[int, int], call: int) -> torch.Tensor:
        """``attend`` where q, k, v switch as they are: the sequence one axis (or a fold that splits evenly), no
        replicated tokens, no mask. The same collectives and kernel as the general path, without its views."""
        full, comm_dtype, group = self.switch_full[0], self.comm_dtype, self.group
        exact, out_dtype = self.exact_in, self.out_dtype
        # nothing kept or replayed (no checkpoint, or inference): the collectives called as such, without a frame
        # of their own (a frame's return after a collective or kernel is paid again: the caches are cold then)
        direct = recompute.idle()
        if direct:
            q, k, v = exchange._to_heads(q, k, v, seq_dim=seq, head_dim=head, group=group, global_len=full,
                                         replicated=None, comm_dtype=comm_dtype, exact=exact)
        else:
            q, k, v = recompute.replay((self.where, "to_heads", call), lambda q, k, v: exchange._to_heads(
                q, k, v, seq_dim=seq, head_dim=head, group=group, global_len=full, replicated=None,
                comm_dtype=comm_dtype, exact=exact), q, k, v)
        if mine_heads[1] == 0:  # as in attend
            out = v.clone()
        else:
            self.in_kernel = True
            try:
                out = kernel(q, k, v, None)
            finally:
                self.in_kernel = False
        if direct:
            return exchange.from_heads(out, seq_dim=seq, head_dim=head, group=group, global_len=full, heads=heads,
                                       comm_dtype=out_dtype)
        return recompute.replay((self.where, "from_heads", call), lambda o: exchange.from_heads(
            o, seq_dim=seq, head_dim=head, group=group, global_len=full, heads=heads, comm_dtype=out_dtype), out)

    def _io_mask(self, mask: torch.Tensor, count: int) -> torch.Tensor:
        """A key-padding mask the model built under ``sharded_io`` (from its ``R + L_local`` tokens, or for
        the whole sequence), laid out for the global one: gathered once per forward per mask object."""
        assert self.io_masks is not None
        cached = self.io_masks.get(id(mask))
        if cached is not None and cached[0] is mask:
            return cached[1]
        placed = gather_key_padding(mask, lengths=self.lengths, axis=self.axis, count=count, joint=self.joint,
                                    group=self.group)
        self.io_masks[id(mask)] = (mask, placed)  # the mask is kept: its id is not reused in this forward
        return placed

    def _check(self, q: torch.Tensor, k: torch.Tensor, mask: Any, seq: int, head: int, count: int,
               total: int) -> ValueError | None:
        """This rank's reason not to switch (found before any collective), or None."""
        local = self.local
        if q.shape[seq] != k.shape[seq]:
            return ValueError(f"{self.where}: Heads is for self-attention; got {q.shape[seq]} queries and "
                              f"{k.shape[seq]} keys on this rank (leave cross-attention out of Heads)")
        if self.joint is None and count:
            return ValueError(f"{self.where}: the attention holds {q.shape[seq]} tokens, this rank's shard of the "
                              f"sequence {[b for _, b in self.lengths]} is {math.prod(local)}; if the module joins "
                              f"tokens every rank holds whole (text in joint attention), say where: "
                              f"Heads(joint='first' or 'last')")
        if count < 0:
            return ValueError(f"{self.where}: Heads(joint={self.joint!r}) expects the replicated tokens plus this "
                              f"rank's {math.prod(local)} tokens of the sequence {[b for _, b in self.lengths]}, "
                              f"got {q.shape[seq]} tokens")
        why = check_mask(self.where, mask, batch=q.shape[0], heads=q.shape[head], queries=total + count,
                         keys=total + count, local_keys=q.shape[seq], sharded_io=self.io_masks is not None)
        return None if why is None else ValueError(why)


def _unfolded(t: torch.Tensor, dim: int, lengths: list[int]) -> torch.Tensor:
    """``t`` with dim ``dim`` unfolded into ``lengths`` (a dim of one axis as it is)."""
    return t.unflatten(dim, lengths) if len(lengths) > 1 else t


_FIXED: dict[tuple[Any, ...], dict[str, Any]] = {}  # a Heads placement -> what it fixes (HeadsCall.__init__)
_FIXED_LIMIT = 1024


def _fixed_for(where: str, lengths: list[tuple[int, int]], axis: int, n: int, rank: int, joint: str | None,
               comm_dtype: object, exact: tuple[str, ...]) -> dict[str, Any]:
    """``_fixed``, kept per placement for the next calls (eager only). Keyed by the group's size and this rank's
    place, not the group (a destroyed one would stay alive)."""
    key = (where, tuple(lengths), axis, n, rank, joint, comm_dtype, exact)
    fixed = _FIXED.get(key)
    if fixed is None:  # the first call of this placement: what it fixes, kept for the next calls
        fixed = _fixed(where, lengths, axis, n, rank, joint, comm_dtype, exact)
        if len(_FIXED) >= _FIXED_LIMIT:
            _FIXED.clear()
        _FIXED[key] = fixed
    return fixed


# a Heads module path -> (the grid, the layout, its placement, what enter_heads made of it last: lengths, sharded axis
# index, the fixed attributes): the next call in the same placement (the same grid object, kept on the block's input
# tag by the runtime) takes them as they are
_PLACED: dict[str, tuple[Any, ...]] = {}


def _fixed(where: str, lengths: list[tuple[int, int]], axis: int, n: int, rank: int,
           joint: str | None, comm_dtype: object, exact: tuple[str, ...]) -> dict[str, Any]:
    """A ``HeadsCall``'s attributes that its placement fixes: the same for every call of the module at one grid."""
    local, full = [a for a, _ in lengths], [b for _, b in lengths]
    mine, total = math.prod(local), math.prod(full)
    # the axes the switch sees: the sharded one unfolded from the others; when it is the outermost and
    # splits evenly, this rank's tokens are one even block of the folded sequence (the same elements in the
    # same order), so the folded sequence switches as one axis, without views to unfold and fold it
    even = axis == 0 and full[0] % n == 0
    switch = ([mine], [total], 0) if even else (local, full, axis)
    return {"where": where, "lengths": lengths, "axis": axis, "joint": joint, "local": local,
            "full": full, "mine": mine, "total": total, "n": n, "rank": rank, "switch_local": switch[0],
            "switch_full": switch[1], "switch_axis": switch[2], "comm_dtype": comm_dtype, "exact": exact,
            "exact_in": tuple(e for e in exact if e != "out"),  # the payload's exceptions into the switch
            "out_dtype": None if "out" in exact else comm_dtype,  # and out of it
            "checked": set(),  # (q shape, k shape, seq, head) whose unmasked call passed _check
            "heads_of": {}}  # heads -> this rank's (first, count)


class _HeadSwitchMode(TorchFunctionMode):
    """``scaled_dot_product_attention`` inside a ``Heads`` module call, through ``HeadsCall.attend``."""

    def __init__(self, call: HeadsCall) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is not F.scaled_dot_product_attention or self.call.in_kernel:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        sdpa = dict(zip(_SDPA, args)) | kwargs
        q, k, v = sdpa.pop("query"), sdpa.pop("key"), sdpa.pop("value")
        mask = sdpa.pop("attn_mask", None)
        self.call.via_sdpa += 1
        return self.call.attend(lambda q, k, v, m: func(q, k, v, attn_mask=m, **sdpa), q, k, v, mask, seq=2, head=1)


class EmptyShardMode(TorchFunctionMode):
    """``scaled_dot_product_attention`` over no queries, inside a block whose shard is empty on this rank.

    A rank's shard is empty when the group has more ranks than the sharded axis has positions. Seen on an
    NVIDIA H200 with torch 2.11 (``scripts/gpu_check/attention.py``): cuDNN's kernel and SDPA's default
    choice return None for a batch of 0 or no heads, and flash attention kills the process (SIGFPE) on no
    heads. Attention over no queries is empty whatever the kernel, so it is returned without calling one,
    still in the autograd graph (q, k and v get their empty gradients). A ``Heads`` call inside passes
    through: the head switch gathers the sequence before its kernel, and skips a rank with no head itself.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or current_call() is not None:
            return func(*args, **kwargs)
        sdpa = dict(zip(_SDPA, args)) | kwargs
        q, k, v = sdpa["query"], sdpa["key"], sdpa["value"]
        if q.numel():
            return func(*args, **kwargs)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + (q.sum() + k.sum() + v.sum()).to(q.dtype) * 0


def current_call() -> HeadsCall | None:
    """The innermost ``Heads`` module call of this thread, or None."""
    calls = getattr(_local, "calls", None)
    return calls[-1] if calls else None


def enter_heads(where: str, group: Any, joint: str | None = None, *, comm_dtype: object = None,
                exact: tuple[str, ...] = (), io: tuple[str | None, dict[int, Any]] | None = None,
                sdpa: bool = True, members: tuple[int, int] | None = None,
                block: tuple[dict[str, int], str, Any] | None = None) -> None:
    """Open a ``Heads`` module call. ``io``: under ``sharded_io``, the axis the model is fed shards of and the
    forward's mask cache (a key-padding mask built from the shard is laid out when the call is sharded there).
    ``sdpa=False``: without the SDPA level (the caller knows the module attends through diffusers' dispatch).
    ``members``: the group's (size, this rank's place), when the caller resolved them for this forward.
    ``block``: the enclosing block's (grid, sharded axis, layout), where its hooks did not run (else the
    innermost block open on this thread's stack, ``current_block``)."""
    if block is None:
        block = current_block()
    if block is None:
        raise ValueError(f"{where}: a Heads module must run inside a Block of the plan (its placement gives "
                         f"the global sequence length)")
    grid, shard, lay = block
    n, rank = (group_size(group), group_rank(group)) if members is None else members
    io_masks = io[1] if io is not None and io[0] == shard else None
    compiling = torch.compiler.is_compiling()
    placement = (shard, n, rank, joint, comm_dtype, exact)
    hit = None if compiling else _PLACED.get(where)
    if hit is not None and hit[0] is grid and hit[1] is lay and hit[2] == placement:
        lengths, axis, fixed = hit[3:]
    else:
        names = lay.dims[lay.dim_of(shard)]
        lengths = [(chunk_sizes(grid[a], n)[rank] if a == shard else grid[a], grid[a]) for a in names]
        axis = names.index(shard)
        fixed = None if compiling else _fixed_for(where, lengths, axis, n, rank, joint, comm_dtype, exact)
        if not compiling:
            if len(_PLACED) >= _FIXED_LIMIT:
                _PLACED.clear()
            _PLACED[where] = (grid, lay, placement, lengths, axis, fixed)
    call = HeadsCall(where, lengths, axis, group, joint, comm_dtype, exact, io_masks, sdpa=sdpa, members=(n, rank),
                     fixed=fixed)
    # under torch.compile only diffusers' dispatch is intercepted: dynamo cannot trace a TorchFunctionMode
    # entered outside a ``with``; a model that calls SDPA directly then ends its Heads call unswitched,
    # which exit_heads refuses (never a silent local attention)
    call.mode_entered = sdpa and not torch.compiler.is_compiling()
    if call.mode_entered:
        call.mode = _HeadSwitchMode(call)
        call.mode.__enter__()
    calls = getattr(_local, "calls", None)
    if calls is None:
        calls = _local.calls = []
    calls.append(call)


def exit_heads() -> HeadsCall | None:
    """Close this thread's innermost ``Heads`` call and return it; raise if it intercepted no attention (its
    forward returned)."""
    calls = getattr(_local, "calls", [])
    if not calls:
        return None
    call = calls.pop()
    if call.mode is not None and call.mode_entered:
        call.mode.__exit__(None, None, None)
    if call.attended == 0 and sys.exc_info()[1] is None:
        levels = ("neither torch.nn.functional.scaled_dot_product_attention nor a diffusers attention backend ran "
                  "inside it" if call.sdpa else
                  "no diffusers attention backend ran inside it, as one did in its earlier calls: the SDPA level "
                  "was not watched in this call; it is from the next call on")
        raise RuntimeError(
            f"{call.where}: this Heads module finished without an attention call the head switch intercepted "
            f"({levels}), so its attention saw only this rank's {call.mine} tokens. Expected its attention "
            f"through one of those two; for a custom kernel, register it as a diffusers attention backend or call "
            f"dsp_plugin.to_heads / from_heads around it (docs/models.md, 'Attention backends')")
    return call
