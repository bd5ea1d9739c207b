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
``dsp_plugin.comm.sharded_calls()`` and a fingerprint of the inputs; the
post-hook counts the calls the forward made, and one all-gather over all ranks
(``comm.all_gather_rows``) shares both, so every rank reaches the same verdict
and raises the same ``DSPGuardError`` before any gradient exists, instead of
one rank raising while its peers wait in the next collective. Then the hooks
remove themselves: one small collective per run. ``DSP_DEEPSPEED_GUARD=0``
turns it off (a model that is fed pre-sharded inputs on purpose).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from dsp_plugin.comm import sharded_calls
from dsp_plugin.deepspeed.comm import all_gather_rows
from dsp_plugin.topology import Topology

__all__ = ["GUARD_ENV", "DSPGuardError", "input_fingerprint", "install_guard"]

GUARD_ENV = "DSP_DEEPSPEED_GUARD"
_HANDLES = "_dsp_guard_hooks"


class DSPGuardError(RuntimeError):
    """The model or the data do not follow DSP's contract; raised identically on every rank."""


def input_fingerprint(args: Any, kwargs: Any) -> torch.Tensor:
    """Three float64 numbers that differ when the forward's tensor inputs differ (count, weighted sums)."""
    count, first, second = 0.0, 0.0, 0.0
    for i, leaf in enumerate(x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)):
        values = leaf.detach().double()
        count += 1
        first += (i + 1) * (float(values.sum()) + leaf.numel())
        second += (i + 1) * float((values * values).sum())
    return torch.tensor([count, first, second], dtype=torch.float64)


def _ranks_disagreeing(fingerprints: torch.Tensor, dsp_groups: list[list[int]]) -> list[list[int]]:
    bad = []
    for ranks in dsp_groups:
        mine = fingerprints[ranks]
        if not torch.allclose(mine, mine[0].expand_as(mine), rtol=1e-9, atol=0.0):
            bad.append(ranks)
    return bad


def _verdict(rows: torch.Tensor, topology: Topology) -> str | None:
    """The error every rank raises, computed from everyone's row; None if the forward was DSP-aware."""
    unsharded = [rank for rank, row in enumerate(rows.tolist()) if row[0] == 0]
    size = topology.dsp
    if unsharded:
        return (f"dsp_plugin.deepspeed: the config sets 'sequence_parallel_mode': 'dsp' with "
                f"sequence_parallel_size={size}, but the first forward issued no DSP split or switch on "
                f"rank(s) {unsharded}. Every DSP rank would compute the whole sequence and ZeRO would sum "
                f"{size} identical gradients: training with gradients {size}x too large. Make the model "
                f"DSP-aware before initialize: dsp_plugin.models.parallelize(model) for an STDiT-style model, or "
                f"call dsp_plugin.split / dynamic_switch / gather in its forward (docs/deepspeed.md, 'From a "
                f"DeepSpeed script to DSP'); or remove 'sequence_parallel_mode' to train without DSP.")
    bad = _ranks_disagreeing(rows[:, 1:], topology.layout["dsp"])
    if bad:
        return (f"dsp_plugin.deepspeed: the first forward's inputs differ inside DSP group(s) {bad}. The ranks "
                f"of a DSP group must receive the same samples (they split the sequence themselves); use the "
                f"loader dsp_plugin.deepspeed.initialize returns for training_data, or wrap yours in "
                f"dsp_plugin.dsp_dataloader. If the inputs are pre-sharded on purpose, set {GUARD_ENV}=0.")
    return None


def install_guard(module: torch.nn.Module, topology: Topology, *,
                  device: torch.device | str = "cpu") -> bool:
    """Check the first forward of ``module`` on every rank; returns whether the guard was installed.

    Not installed for DSP size 1 (nothing to shard) or with ``DSP_DEEPSPEED_GUARD=0``.
    ``device`` is where the agreement tensor lives (the communication backend's device).
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
        issued = float(sharded_calls() - state["calls"])
        row = torch.cat([torch.tensor([issued], dtype=torch.float64), state["fingerprint"]])
        rows = all_gather_rows(row.to(device), group=dist.group.WORLD).cpu()
        message = _verdict(rows, topology)
        if message is not None:
            raise DSPGuardError(message)

    setattr(module, _HANDLES, [module.register_forward_pre_hook(before, with_kwargs=True),
                               module.register_forward_hook(after, with_kwargs=True)])
    return True
