"""Apply DSP to a multi-dimensional transformer from outside, with forward hooks.

The model code stays single-device. ``parallelize`` registers:

- a pre-hook on the entry module that splits its input (``split``),
- a pre-hook on every block whose ``attend_dim`` is the dim currently sharded,
  switching the shard to another sequence dim first (``dynamic_switch``),
- a pre-hook on the exit module that gathers its input (``gather``).

Which dim to switch to is decided once, from the block order
(``switch_schedule``): among the sequence dims the block does not attend, the
one whose next use is furthest away (Belady's rule). For spatial/temporal
blocks that is simply the other dim: one switch per block, two per layer. With
three axes it saves a switch every other block.

The full length of the sharded dim travels with the activation (``dsp_plugin.layout``):
``split`` and ``dynamic_switch`` tag their outputs, and a forward hook on each
block and on the entry carries the tag from a module's input to its output. No
per-forward or per-model state: two forwards of different lengths may be in
flight (activation checkpointing), threads may share a model, and every switch
is exactly one ``all_to_all_single`` with no host sync, even for uneven lengths.
The activation may be passed positionally or as a keyword (``DSPPlan.arg``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin import layout
from dsp_plugin.comm import dynamic_switch, gather, split
from dsp_plugin.plan.schedule import switch_schedule

__all__ = ["DSPPlan", "parallelize", "switch_schedule"]


@dataclass
class DSPPlan:
    """Where the hooks go. Module names are ``model.get_submodule`` paths."""

    entry: str                      # module whose first positional input is split
    entry_split_dim: int            # dim of that input to split
    entry_shard: int                # token dim the split becomes (the first shard)
    blocks: list[str]               # blocks in execution order, each with `.attend_dim`
    sequence_dims: tuple[int, ...]  # token dims that are sequences
    exit: str                       # module whose first positional input is gathered
    arg: str = "x"                  # the blocks' activation argument when passed by keyword
    passthrough: tuple[str, ...] = ()  # modules after the blocks that keep the sharding (e.g. a final norm)

    @staticmethod
    def for_stdit(model: nn.Module) -> DSPPlan:
        """STDiT: split the latents on T (dim 2; frames are embedded independently), gather before unpatchify."""
        names = [f"blocks.{i}" for i in range(len(model.blocks))]
        return DSPPlan(entry="embedder", entry_split_dim=2, entry_shard=1, blocks=names,
                       sequence_dims=model.sequence_dims, exit="unpatchify", passthrough=("final_layer",))


def parallelize(model: nn.Module, *, group: dist.ProcessGroup | None = None,
                plan: DSPPlan | None = None) -> nn.Module:
    """Register the DSP hooks on ``model`` (in place) and return it.

    ``group=None`` means the DSP group of the current topology at call time.
    ``model.dsp_schedule`` describes the switches, for logs and tests.
    """
    if getattr(model, "_dsp_hooks", None):
        raise ValueError("parallelize: this model already has DSP hooks")
    plan = plan or DSPPlan.for_stdit(model)
    blocks = [model.get_submodule(name) for name in plan.blocks]
    attend = [block.attend_dim for block in blocks]
    schedule, final_shard = switch_schedule(attend, plan.sequence_dims, plan.entry_shard)
    def entry_pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (split(args[0], plan.entry_split_dim, group=group), *args[1:])

    def entry_post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # the entry maps the split dim of its input to the token dim `entry_shard`
        full = layout.global_len_of(args[0], plan.entry_split_dim)
        if full is not None and isinstance(output, torch.Tensor):
            layout.attach(output, plan.entry_shard, full)

    def block_pre(switch: tuple[int, int]):  # noqa: ANN202
        cur, tgt = switch

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            return _with_activation(args, kwargs, plan.arg, lambda x: dynamic_switch(x, cur, tgt, group=group))

        return hook

    def block_post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        layout.propagate(_activation(args, kwargs, plan.arg), output)

    def exit_pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (gather(args[0], final_shard, group=group), *args[1:])

    entry = model.get_submodule(plan.entry)
    handles = [entry.register_forward_pre_hook(entry_pre), entry.register_forward_hook(entry_post)]
    for block, switch in zip(blocks, schedule):
        if switch is not None:
            handles.append(block.register_forward_pre_hook(block_pre(switch), with_kwargs=True))
        handles.append(block.register_forward_hook(block_post, with_kwargs=True))
    for name in plan.passthrough:
        handles.append(model.get_submodule(name).register_forward_hook(block_post, with_kwargs=True))
    handles.append(model.get_submodule(plan.exit).register_forward_pre_hook(exit_pre))
    model._dsp_hooks = handles
    model.dsp_schedule = [
        f"{name} (attends {a}): " + (f"switch S({s[0]}) -> S({s[1]})" if s else "local")
        for name, a, s in zip(plan.blocks, attend, schedule)
    ]
    return model


def _activation(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    raise TypeError(f"DSP plan: a block was called without its activation: no positional argument and no "
                    f"keyword {name!r} (got keywords {sorted(kwargs)}); set DSPPlan.arg to its name")


def _with_activation(args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
                     fn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the activation replaced by ``fn(activation)``."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, name: fn(_activation(args, kwargs, name))}
