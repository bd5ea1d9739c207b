"""Small models for the user-path tests (issue 25): shapes users write that the built-in plans do not cover.

- ``Net`` / ``AttributeAdapter``: a hand-written DSP forward that calls ``emb.proj`` and reads
  ``emb.cls_token`` as an attribute (``emb``'s own forward never runs) on the rank holding frame 0
  only: a parameter used outside its module's forward, on some ranks.
- ``TokenMLP`` with ``ROOT_SPLIT_PLAN``: a plan that splits the model's own input (``""``), as
  LTX-Video's does; the DeepSpeed guard must compare the replicated input, not the shards.

Frames ``[B, T, 4]``; every layer is per token, so no switch is needed and the one-process
oracle is the same module's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsp_plugin.plan import Gather, Split

__all__ = ["ATTRIBUTE_PLAN", "ROOT_SPLIT_PLAN", "AttributeAdapter", "Net", "TokenMLP", "sgd_reference"]


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.cls_token = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.cat([h[:, :1] + self.cls_token, h[:, 1:]], dim=1)   # the token joins frame 0


class Net(nn.Module):
    """The single-device model: ``[B, T, 4] -> [B, T, 4]``."""

    def __init__(self, *, unused: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = Embed(), nn.Linear(8, 8), nn.Linear(8, 4)
        if unused:   # no rank uses it: no gradient anywhere, as on one process (torch DDP refuses such a model)
            self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.emb(x))))


class AttributeAdapter(nn.Module):
    """``Net`` made DSP-parallel by hand: split the frames, run ``emb.proj`` (not ``emb``), add
    ``emb.cls_token`` on the rank that holds frame 0 only, gather the frames.

    ``planned=True``: the same forward without the split and gather, which ``ATTRIBUTE_PLAN``
    applies (``dsp_plugin.parallelize(adapter, ATTRIBUTE_PLAN, group=g)``).
    """

    def __init__(self, group: Any = None, *, planned: bool = False, unused: bool = True) -> None:
        super().__init__()
        self.net, self.group, self.planned = Net(unused=unused), group, planned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dsp_plugin import gather, split
        from dsp_plugin.comm import group_rank

        h = self.net.emb.proj(x if self.planned else split(x, 1, group=self.group))
        if group_rank(self.group) == 0:
            h = torch.cat([h[:, :1] + self.net.emb.cls_token, h[:, 1:]], dim=1)
        h = self.net.head(torch.relu(self.net.mix(h)))
        return h if self.planned else gather(h, 1, group=self.group)


ATTRIBUTE_PLAN: dict[str, Any] = {"net.emb.proj": Split(0, "B T D", shard="T"), "net.head": Gather("out", "B T D")}


class TokenMLP(nn.Module):
    """Per-token layers on ``[B, T, 4]``; parallelized by ``ROOT_SPLIT_PLAN`` (split at the model's own input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


ROOT_SPLIT_PLAN: dict[str, Any] = {"": [Split("x", "B T D", shard="T"), Gather("out", "B T D")]}


def sgd_reference(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> dict[str, Any]:
    """One process: SGD on each global batch (MSE); the parameters after the last step, by name."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, target in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}
