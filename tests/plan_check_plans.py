"""Plans for ``tests/test_plan_check.py``: the checker run on good plans and on wrong ones.

The plans for Wan VACE, Cosmos and Kandinsky 5 (``dsp_plugin.testing.tiny_video_more``) are written from
docs/models.md for the checker's tests only; they are not built-in plans."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsp_plugin.plan.builtin import LATTE_PLAN, WAN_PLAN
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Split

# Latte's temporal blocks said to attend the patches (S): they run after a switch to the frames (T), each rank
# attending only its own frames. Runs without an error and is wrong.
WRONG_AXIS_LATTE_PLAN: dict[str, Any] = {
    **LATTE_PLAN,
    "temporal_transformer_blocks.*": Block("(B S) T D", attends="S", then="T", out_shard="T",
                                           follow={"timestep": "(B S)"}),
}

TOKENS = "B (F HW) D"

# diffusers' WanVACETransformer3DModel: Wan's plan, and the control blocks, which run before the main blocks on the
# control stream and return (hint, control stream). The first one takes the video tokens too (both split there);
# the hints stay sharded like the main stream they are added to.
WAN_VACE_PLAN: dict[str, Any] = {
    **WAN_PLAN,
    "vace_blocks.0": [Split("hidden_states", TOKENS, shard="F"), Split("control_hidden_states", TOKENS, shard="F")],
    "vace_blocks.*": Block(TOKENS, arg="control_hidden_states"),
    "vace_blocks.*.attn1": Heads(),
}

# The control blocks' self-attention left out of the head switch: each rank attends its own frames only. The
# blocks return a tuple; the checker must compare both of its elements.
WRONG_WAN_VACE_PLAN: dict[str, Any] = {k: v for k, v in WAN_VACE_PLAN.items() if k != "vace_blocks.*.attn1"}

# diffusers' CosmosTransformer3DModel: tokens [B, F*H*W, D] split by frames at the first block; its RoPE (cos, sin)
# [F*H*W, K] and learnable positions [B, F*H*W, D], computed for the global tokens, are split the same way.
COSMOS_PLAN: dict[str, Any] = {
    "": Grid(F=("hidden_states", 2)),
    "rope": Split("out", "(F HW) K", shard="F"),
    "learnable_pos_embed": Split("out", TOKENS, shard="F"),
    "transformer_blocks.0": Split("hidden_states", TOKENS, shard="F"),
    "transformer_blocks.*": Block(TOKENS, arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(),
    "norm_out": Gather("hidden_states", TOKENS),
}

# diffusers' Kandinsky5Transformer3DModel: the text blocks stay whole on every rank; the visual tokens [B, F*H*W, D]
# are split by frames at the first visual block, their RoPE [B, F*H*W, 1, K, 2, 2] follows them into every block,
# and they are gathered at the last visual block's output (the model unflattens them with the global shape next).
KANDINSKY5_PLAN: dict[str, Any] = {
    "": Grid(F=("hidden_states", 1)),
    "visual_transformer_blocks.0": Split("visual_embed", TOKENS, shard="F"),
    "visual_transformer_blocks.*": Block(TOKENS, arg="visual_embed", follow={"rope": "B (F HW)"}),
    "visual_transformer_blocks.*.self_attention": Heads(),
    "visual_transformer_blocks.1": Gather("out", TOKENS),
}


class TupleBlock(nn.Module):
    """Returns (its projection, the projection's running sum along S): the second mixes the S axis."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)  # [B, T, S, D]
        return h, h.cumsum(dim=2)


class TupleModel(nn.Module):
    """A block returning a tuple whose second tensor the model drops, as Wan VACE drops its last control block's
    control stream."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.block, self.head = TupleBlock(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.block(x)
        return self.head(h)


def tuple_case() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``--model tests.plan_check_plans:tuple_case``: 5 frames of 3 tokens (uneven on 2 ranks)."""
    return TupleModel(), (torch.randn(2, 5, 3, 4),)


# Sharded on T, which nothing in the block mixes: right.
TUPLE_PLAN: dict[str, Any] = {"block": [Split("x", "B T S D", shard="T"), Block("B T S D", arg="x")],
                              "head": Gather(0, "B T S D")}
# Sharded on S, which the block's running sum mixes: its output[1] is wrong on every rank, its output[0] right.
WRONG_TUPLE_PLAN: dict[str, Any] = {"block": [Split("x", "B T S D", shard="S"), Block("B T S D", arg="x")],
                                    "head": Gather(0, "B T S D")}


class GatherFirst(nn.Module):
    """A module whose input the plan gathers, called before anything is split (LTX-2's audio attention gathering
    its key RoPE, which no Split placed)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.side, self.block = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)
        return self.block(x) + side.sum()


GATHER_UNTAGGED_PLAN: dict[str, Any] = {"block": Split(0, "B L D", shard="L"), "side": Gather(0, "B L D")}
