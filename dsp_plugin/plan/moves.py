"""What a plan's hooks do to activations: split, gather, place a block's input, switch its output.

The methods of the plan runtime (``plan.runtime._Runtime``) that move or tag a tensor:

- ``split`` / ``split_plan``: a ``Split`` cuts a replicated activation (partial adjoint, no communication)
  and tags it with the carrier's ``ShardSpec``;
- ``gather`` / ``gather_out``: a ``Gather`` all-gathers what carries a tag in its layout (or, untagged, what
  the frame places);
- ``block_pre`` / ``placed`` / ``place_untagged`` / ``on_shard``: a ``Block``'s activation placed from its
  tag or the frame, switched when the block attends the sharded axis, its per-row conditioning split with it,
  an empty shard's mode opened;
- ``block_post``: the block's output switched where the plan asks, tagged, and the frame told what placement
  the block hands on.

A mixin: the runtime holds the group, the frame and the plan these read (``self.n``, ``self.frame()``, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin import layout as carrier
from dsp_plugin.comm import chunk_sizes, group_rank, group_size
from dsp_plugin.plan import ops
from dsp_plugin.plan.args import Args as _Args
from dsp_plugin.plan.args import map_tensors as _map_tensors
from dsp_plugin.plan.args import tensors as _tensors
from dsp_plugin.plan.frames import Frame, OnShard, current_block, frames
from dsp_plugin.plan.local_args import localize
from dsp_plugin.plan.placement import GRID_ATTR as _GRID_ATTR
from dsp_plugin.plan.placement import complete as _complete
from dsp_plugin.plan.placement import holds_all as _holds_all
from dsp_plugin.plan.placement import is_full as _is_full
from dsp_plugin.plan.placement import split_rows as _split_rows
from dsp_plugin.plan.placement import untagged as _untagged
from dsp_plugin.plan.spec import Block, Gather, Split
from dsp_plugin.plan.wrap import not_a_tensor

__all__ = ["ONSHARD_ATTR", "Moves"]

ONSHARD_ATTR = "_dsp_plan_on_shard"


class Moves:
    """The runtime's methods that split, gather, place and switch activations (mixed into ``_Runtime``)."""

    def gather_out(self, where: str, output: Any, spec: Gather) -> Any:
        """A module's output gathered: every tensor of it that carries a shard tag in the layout, or, if none
        does, its first (a block's activation, placed by the frame); other tensors (text carried beside the
        video, replicated on every rank) pass through."""
        found = [self.placed(where, spec, t) for t in _tensors(output)]
        sharded = [f[1] is not None for f in found]
        chosen = iter(zip(sharded if any(sharded) else [i == 0 for i in range(len(found))], found))

        def gathered(t: torch.Tensor) -> torch.Tensor:
            gather, placement = next(chosen)
            return self.gather(where, t, spec, placement) if gather else t

        return _map_tensors(output, gathered)

    def split(self, where: str, x: Any, spec: Split) -> Any:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{where}: expected a tensor to split, got {type(x).__name__}")
        frame = self.frame()
        members = self.members(frame)
        if frame is not None and frame.sharded_io and not _is_full(x, spec, frame.grid):  # already a shard
            grid = ops.infer_grid(where, x, spec.layout, frame.grid, shard=spec.shard, group=self.group,
                                  members=members)
            frame.grid, frame.shard, frame.io_shard, frame.passing = grid, spec.shard, spec.shard, None
            return ops.tag(x, spec.layout, grid, spec.shard)
        # a recompute under activation checkpointing runs this hook again on the same input, in backward,
        # where no frame is open: the grid is kept on the replicated input itself
        known = frame.grid if frame is not None else carrier.noted(x, _GRID_ATTR, {})
        grid, rows = self.split_plan(where, x, spec, known, members)
        carrier.note(x, _GRID_ATTR, grid)
        if frame is not None:
            frame.grid, frame.shard, frame.passing = grid, spec.shard, None
        if rows is not None:
            return ops.cut(x, rows)
        return ops.plan_split(where, x, spec.layout, grid, spec.shard, self.group, members=members)

    def split_plan(self, where: str, x: torch.Tensor, spec: Split, known: dict[str, int],
                   members: tuple[int, int]) -> tuple[dict[str, int], Any]:
        """(``known`` completed with the axes of the full tensor ``x``: ``ops.infer_grid``, the block of rows this
        rank's chunk is: ``ops.row_split``, or None), kept per (call site, shape, known lengths, members): a
        forward's splits meet the same ones every step. The grid is shared, never changed. Keyed by the call site's
        name, not ``id(spec)``: ``id`` is an audited builtin, a Python call into every audit hook (filelock, which
        diffusers imports, installs one)."""
        compiling = torch.compiler.is_compiling()  # the shapes may be symbolic (dynamic=True): no cache
        key = None if compiling else (where, x.shape, tuple(known.items()), members)
        hit = self.splits.get(key) if key is not None else None
        if hit is None:
            grid = ops.infer_grid(where, x, spec.layout, known, group=self.group)
            rows = ops.row_split(where, x, spec.layout, grid, spec.shard, members) if members[0] > 1 else None
            hit = (grid, rows)
            if key is not None:
                if len(self.splits) >= 256:
                    self.splits.clear()
                self.splits[key] = hit
        return hit

    def gather(self, where: str, x: Any, spec: Gather, found: tuple[Any, Any, bool] | None = None) -> Any:
        """``x`` gathered (or under ``sharded_io`` switched back to the caller's axis); ``found``: what ``placed``
        said of it, where the caller asked already."""
        frame = self.frame()
        if found is None:
            found = self.placed(where, spec, x) if isinstance(x, torch.Tensor) else (None, None, False)
        _, placed, whole = found
        block = current_block() if placed is None and frame is None else None  # a recompute: its block's placement
        if placed is None and block is None and (frame is None or frame.shard is None):
            raise ValueError(_untagged(where, x, frame))
        grid, shard = placed if whole else _complete(where, x, spec.layout, placed, frame) if placed is not None \
            else block[:2] if block is not None else (frame.grid, frame.shard)
        if frame is not None and frame.sharded_io and not spec.partial_grad:  # the caller wants its shard back
            if frame.io_shard is not None and frame.io_shard != shard and frame.io_shard in spec.layout.axes:
                x = ops.plan_switch(where, x, spec.layout, grid, shard, frame.io_shard, self.group,
                                    comm_dtype=self.comm_dtype, members=self.members(frame))
                frame.shard = shard = frame.io_shard
                frame.passing = None
            return ops.tag(x, spec.layout, grid, shard)
        if frame is not None and not spec.partial_grad:  # a partial_grad gather feeds sharded work: still sharded
            frame.shard = frame.passing = None
        return ops.plan_gather(where, x, spec.layout, grid, shard, self.group, members=self.members(frame),
                               partial_grad=spec.partial_grad)

    def block_pre(self, path: str, a: _Args, spec: Block) -> dict[str, Any]:
        """Place the block's activation (switching it when the block attends the sharded axis); return the
        state of its ``("block", ...)`` frame (``pre`` opens ``EmptyShardMode`` there on an empty shard)."""
        for name, why in spec.refuse.items():   # every rank gets the same call: all refuse, before any collective
            if a.get(name) is not None:
                raise ValueError(f"{path}: the call passes {name}, which this plan cannot serve: {why}; "
                                 f"expected {name}=None")
        x = original = a.get(spec.arg)
        if not isinstance(x, torch.Tensor):  # what the call passed; a forward replaced after parallelize (wrap.py)
            raise ValueError(not_a_tensor(path, a.module, a.name(spec.arg), x))
        frame = self.frame()
        tag, placed, whole = self.placed(path, spec, x)
        grid, shard = placed if whole else self.place_untagged(path, x, spec, placed, frame)
        if spec.attends is not None and spec.attends == shard:
            if spec.then is None:
                raise ValueError(f"{path}: the block attends {shard!r}, the sharded axis; set Block.then to "
                                 f"the axis to switch to")
            x = ops.plan_switch(path, x, spec.layout, grid, shard, spec.then, self.group,
                                comm_dtype=None if spec.exact else self.comm_dtype, members=self.members(frame))
            shard = spec.then
        if x is not original:  # switched; else the call's own argument stands (tagged in place)
            a.set(spec.arg, x)
        if spec.local:  # integer arguments computed from global lengths: this rank's (plan/local_args.py)
            localize(path, a, spec, grid, shard, self.members(frame))
        for name, rows in spec.follow.items():
            c = a.get(name)
            if isinstance(c, torch.Tensor) and shard in rows.axes:
                a.set(name, _split_rows(f"{path}: follow {name!r}", c, rows, grid, shard, self.group))
        # the input's tag, where it is the output's too (not switched): block_post tags with it, not a new one
        state: dict[str, Any] = {"empty": x.numel() == 0, "mode": None, "tag": tag if x is original else None}
        frames().append(("block", spec, grid, shard, state))
        return state

    def placed(self, site: str, spec: Block | Gather, x: torch.Tensor) -> tuple[Any, Any, bool]:
        """(the tag on ``x`` itself, its placement read in the spec's layout: ``ops.read_spec``, whether that holds
        every global length the layout needs: no ``placement.complete`` then). Kept per call site (``site``: the
        block's path, the gather's name) when it does, so the next forward's same tag on the same shape is not read
        again (tags are immutable and, made by ``ops.spec_for``, one object per placement). Without a tag of its
        own (an alias's, or none): (None, ...)."""
        tag = getattr(x, carrier.TAG_ATTR, None)
        compiling = torch.compiler.is_compiling()  # the shapes may be symbolic (dynamic=True): no cache
        if tag is not None and not compiling:
            hit = self.tag_placed.get(site)
            if hit is not None and hit[0] is tag and hit[1] == x.shape:
                return tag, hit[2], True
        placed = ops.read_spec(x, spec.layout)
        if tag is None or placed is None or compiling:
            return None, placed, False
        if not _holds_all(spec.layout, *placed):
            return tag, placed, False
        if len(self.tag_placed) >= 256:
            self.tag_placed.clear()
        self.tag_placed[site] = (tag, x.shape, placed)
        return tag, placed, True

    def place_untagged(self, path: str, x: torch.Tensor, spec: Block, placed: Any,
                       frame: Frame | None) -> tuple[dict[str, int], str]:
        """The block input's placement, completed (``placement.complete``): from its tag (``placed``), or where
        it carries none, from the forward's frame (``x`` is tagged then, for a recompute)."""
        if placed is None:
            # a recompute (no frame) of a block nested in another (SanaVideo's temporal convolution inside its
            # block's feed-forward, on a tensor made there): the enclosing block's placement
            held = (frame.grid, frame.shard) if frame is not None else (current_block() or (None, None))[:2]
            if held[1] is None:
                raise ValueError(f"{path}: the activation carries no shard tag and no forward of this model "
                                 f"is in progress; expected a Split before this block")
            # untagged: the frame holds the placement (the model, or a framework's module hook such as
            # ZeRO-3's, passed a new tensor); the lengths of whole dims come from the tensor, like a tag's
            ops.tag(x, spec.layout, *held)  # in place, so a recompute finds the placement on
            tagged = ops.read_spec(x, spec.layout)             # its input,
            if tagged is None:
                raise ValueError(f"{path}: the activation of shape {tuple(x.shape)} is not in the block's layout "
                                 f"'{spec.layout}'")
            placed = ({**held[0], **tagged[0]}, held[1])
            # and the lengths of the axes the tag does not hold
            carrier.note(x, _GRID_ATTR, dict(placed[0]))
        return _complete(path, x, spec.layout, placed, frame)

    def on_shard(self, path: str, a: _Args, spec: OnShard, original: Any) -> None:
        frame = self.frame()
        if frame is not None:  # the forward decides; a recompute (no frame) finds the decision on the input
            io = frame.io_shard if frame.sharded_io else None
            if isinstance(original, torch.Tensor):
                carrier.note(original, ONSHARD_ATTR, io)
        else:
            io = carrier.noted(original, ONSHARD_ATTR) if isinstance(original, torch.Tensor) else None
        if io is None:
            return
        block = current_block()
        if block is None:
            raise ValueError(f"{path}: OnShard needs a Block on the same module (listed before it)")
        grid = block[0]
        n, rank = group_size(self.group), group_rank(self.group)
        # the lengths the model saw: its input was this rank's shard of the io axis
        local = {k: chunk_sizes(v, n)[rank] if k == io else v for k, v in grid.items()}
        a.set(spec.arg, spec.fn(self.model, a.get(spec.arg), grid, local))

    def block_post(self, path: str, spec: Block, output: Any) -> Any:
        stack = frames()
        entry = stack[-1] if stack else None  # the block's own frame is the innermost one (unless a hook failed)
        if isinstance(entry, tuple) and entry[1] is spec:
            stack.pop()
        else:
            entry = next((f for f in reversed(stack) if isinstance(f, tuple) and f[1] is spec), None)
            if entry is None:
                return output
            stack.remove(entry)
        _, _, grid, shard, state = entry
        if state["mode"] is not None:
            state["mode"].__exit__(None, None, None)
            state["mode"] = None
        if output is None:
            return None
        first = output[0] if isinstance(output, tuple) else output
        frame = self.frame()
        if spec.out_shard is not None and spec.out_shard != shard:
            first = ops.plan_switch(path, first, spec.layout, grid, shard, spec.out_shard, self.group, tail=True,
                                    comm_dtype=None if spec.exact else self.comm_dtype, members=self.members(frame))
            shard = spec.out_shard
        elif state["tag"] is not None and isinstance(first, torch.Tensor):
            first = carrier.attach_spec(first, state["tag"])  # the input's placement: the same tag ops.tag would make
        else:
            first = ops.tag(first, spec.layout, grid, shard)
        if frame is not None:
            frame.grid, frame.shard = grid, shard
            # a block that switches hands on no placement: a tensor tagged before its switch may feed a later block
            switches = spec.attends is not None or spec.out_shard is not None
            tag = getattr(first, carrier.TAG_ATTR, None) if isinstance(first, torch.Tensor) else None
            frame.passing = None if state["empty"] or switches or tag is None or torch.compiler.is_compiling() \
                else (spec.layout, tag)
        return (first, *output[1:]) if isinstance(output, tuple) else first
