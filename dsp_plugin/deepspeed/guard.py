"""Fail loudly, on every rank, when the DSP key is set but the model does not shard.

With ``"sequence_parallel_mode": "dsp"`` every rank of a DSP group receives the
same samples and ZeRO sums the gradients over the group, because each rank is
expected to hold only its shard's contribution. A model that never calls
``split``/``dynamic_switch`` computes the whole sequence on every rank, so the
sum is DSP times the true gradient: measured 2.000x at DSP=2 (ZeRO-2 and ZeRO-3)
with a loss curve that looks normal. A loader that gives different samples to
the ranks of one DSP group is wrong in the other direction (each rank's shard
comes from another sample).

The guard looks at the first forward through the model. A pre-hook notes
``dsp_plugin.comm.sharded_calls()`` and a fingerprint of the inputs (a hash of
their bytes, dtypes and shapes: it changes under any permutation, and identical
inputs with NaN hash alike); the post-hook counts the calls the forward made.
Two small all-gathers share both, so every rank reaches the same verdict and
raises the same ``DSPGuardError`` before any gradient exists:

1. over the DSP group, in the same format as the primitives' first-call check
   (``comm.exchange_words``): a rank whose model does shard is waiting there in
   ``split``'s agreement when a peer's unsharded forward reaches the guard, so
   the two meet in one all-gather and both raise (the model is DSP-aware on some
   ranks only) instead of waiting in two different collectives;
2. over the world, each rank's verdict for its DSP group, so every DSP group is
   checked and every rank raises when any group is wrong.

Then the hooks remove themselves: two small collectives per run.
``DSP_DEEPSPEED_GUARD=0`` turns it off (a model that is fed pre-sharded inputs
on purpose).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import checks
from dsp_plugin.checks import input_fingerprint
from dsp_plugin.comm import exchange_words, sharded_calls
from dsp_plugin.topology import Topology

__all__ = ["GUARD_ENV", "DSPGuardError", "input_fingerprint", "install_guard"]

GUARD_ENV = "DSP_DEEPSPEED_GUARD"
_HANDLES = "_dsp_guard_hooks"

#: Where the agreement tensors live, or a function that says so at the first forward.
Device = torch.device | str | Callable[[], torch.device | str]


#: Rows of a peer inside DSP's own first-call checks: that peer raises there, so the guard raises at once.
_IN_DSP = (checks.MAGIC, checks.INPUTS_MAGIC)


class DSPGuardError(RuntimeError):
    """The model or the data do not follow DSP's contract; raised identically on every rank."""


def _group_verdict(rows: list[list[int]], ranks: list[int], size: int) -> str | None:
    """This DSP group's error from its members' rows (in group order); None when it is DSP-aware."""
    elsewhere = [r for r, row in zip(ranks, rows) if row[0] in _IN_DSP]
    if elsewhere:
        here = [r for r, row in zip(ranks, rows) if row[0] not in _IN_DSP]
        return (f"dsp_plugin.deepspeed: the model is DSP-aware on some ranks only: rank(s) {elsewhere} of DSP group "
                f"{ranks} are inside a DSP primitive (split / dynamic_switch / gather, or a parallelized model's "
                f"input check) while rank(s) {here} "
                f"finished the first forward without one. Make the same model DSP-aware on every rank "
                f"(dsp_plugin.parallelize(model) on all of them).")
    unsharded = [r for r, row in zip(ranks, rows) if row[1] == 0]
    if unsharded:
        return (f"dsp_plugin.deepspeed: the config sets 'sequence_parallel_mode': 'dsp' with "
                f"sequence_parallel_size={size}, but the first forward issued no DSP split or switch on "
                f"rank(s) {unsharded}. Every DSP rank would compute the whole sequence and ZeRO would sum "
                f"{size} identical gradients: training with gradients {size}x too large. Make the model "
                f"DSP-aware before initialize: dsp_plugin.parallelize(model) (a built-in plan or your own), or "
                f"call dsp_plugin.split / dynamic_switch / gather in its forward (docs/deepspeed.md, 'From a "
                f"DeepSpeed script to DSP'); or remove 'sequence_parallel_mode' to train without DSP.")
    if any(row[2] != rows[0][2] for row in rows):
        return (f"dsp_plugin.deepspeed: the first forward's inputs differ inside DSP group(s) [{ranks}]. The ranks "
                f"of a DSP group must receive the same samples (they split the sequence themselves); use the "
                f"loader dsp_plugin.deepspeed.initialize returns for training_data, or wrap yours in "
                f"dsp_plugin.dsp_dataloader. If the inputs are pre-sharded on purpose, set {GUARD_ENV}=0.")
    return None


def _verdict(rows: torch.Tensor | list[list[int]], topology: Topology) -> str | None:
    """The error every rank raises, from every rank's row ``[magic, calls, fingerprint]`` by global rank."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else rows
    for ranks in topology.layout["dsp"]:
        message = _group_verdict([rows[r] for r in ranks], ranks, topology.dsp)
        if message is not None:
            return message
    return None


def install_guard(module: torch.nn.Module, topology: Topology, *, device: Device = "cpu") -> bool:
    """Check the first forward of ``module`` on every rank; returns whether the guard was installed.

    Not installed for DSP size 1 (nothing to shard) or with ``DSP_DEEPSPEED_GUARD=0``.
    ``device`` is where the agreement tensor lives: the device the communication
    backend is bound to (NCCL: this rank's GPU, ``cuda:LOCAL_RANK``; NCCL refuses a
    collective on any other). A callable is asked at the first forward, for a
    guard installed before the framework binds the device (``engine.py``).
    Calling it again on the same module replaces the earlier hooks.
    """
    for handle in getattr(module, _HANDLES, []):
        handle.remove()
    setattr(module, _HANDLES, [])
    if topology.dsp == 1 or os.environ.get(GUARD_ENV, "1") == "0":
        return False
    state: dict[str, Any] = {}

    def before(_: torch.nn.Module, args: Any, kwargs: Any) -> None:
        state["calls"] = sharded_calls()
        state["fingerprint"] = input_fingerprint(args, kwargs)

    def after(_: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        for handle in getattr(module, _HANDLES, []):
            handle.remove()
        row = [checks.GUARD_MAGIC, sharded_calls() - state["calls"], state["fingerprint"]]
        ranks = dist.get_process_group_ranks(topology.dsp_group)
        where = torch.device(device() if callable(device) else device)
        # 1. the DSP group, in the primitives' check format (a peer may be waiting in split's check)
        mine = exchange_words(row, group=topology.dsp_group, device=where)
        message = _group_verdict(mine, ranks, topology.dsp)
        if message is not None and any(r[0] in _IN_DSP for r in mine):
            raise DSPGuardError(message)   # that peer raises in its own check: nobody is left waiting
        # 2. the world: every DSP group's verdict, so every rank stops when any group is wrong
        world = exchange_words(row, group=dist.group.WORLD, device=where)
        message = _verdict([r[:3] for r in world], topology)
        if message is not None:
            raise DSPGuardError(message)

    # first of the model's pre-hooks: a plan that splits the model's own input (a Split on "") must not have
    # cut it yet, or the ranks' fingerprints of their shards differ although their inputs are the same.
    # Never traced: ``engine.compile()`` (``module.compile``) compiles the module's ``_call_impl``, hooks
    # included, and dynamo traced into these (host reads, collectives, the hooks' own removal) then failed the
    # first forward inside AOTAutograd, DSP-aware model or not; disabled, they run eagerly around the compiled
    # forward, whose trace counts its shards (``comm.sharded_calls``)
    setattr(module, _HANDLES, [
        module.register_forward_pre_hook(torch.compiler.disable(before), with_kwargs=True, prepend=True),
        module.register_forward_hook(torch.compiler.disable(after), with_kwargs=True)])
    return True
