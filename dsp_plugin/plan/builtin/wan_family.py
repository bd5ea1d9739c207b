"""Built-in plans of Wan's family in diffusers 0.42.1: Wan VACE, Wan Animate, ChronoEdit, AnyFlow, Helios.

Wan's blocks: self-attention through the head switch, text cross-attention local,
the tokens split at the first block and gathered before the output stage, the
RoPE tables computed for the global tokens split with them. What each adds is said
above its plan.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.builtin.cross_attention import WAN_PLAN
from dsp_plugin.plan.spec import Block, Gather, Heads, Split

__all__ = ["ANYFLOW_PLAN", "CHRONOEDIT_PLAN", "HELIOS_PLAN", "WAN_ANIMATE_PLAN", "WAN_VACE_PLAN"]

_FRAMES = "B (F HW) D"  # Wan's tokens, whole frames of them per rank (WAN_PLAN)

# diffusers' WanVACETransformer3DModel: Wan's plan, and the control blocks, which run before the main blocks on the
# control stream and return (hint, control stream). The first takes the video tokens too (both split there, whole
# frames); the hints stay sharded like the main stream they are added to after the block of the same index.
WAN_VACE_PLAN: dict[str, Any] = {
    **WAN_PLAN,
    "vace_blocks.0": [Split("hidden_states", _FRAMES, shard="F"), Split("control_hidden_states", _FRAMES, shard="F")],
    "vace_blocks.*": Block(_FRAMES, arg="control_hidden_states"),
    "vace_blocks.*.attn1": Heads(),
}

# diffusers' WanAnimateTransformer3DModel: Wan's plan on whole frames. The face adapter after every
# inject_face_latents_blocks-th block attends each frame's tokens to that frame's motion vectors [B, F, N, C]
# (one per latent frame, the first a zero pad): the vectors follow the frames.
WAN_ANIMATE_PLAN: dict[str, Any] = {
    **WAN_PLAN,
    "face_adapter.*": Split("encoder_hidden_states", "B F Nm Cm", shard="F"),
}

# diffusers' ChronoEditTransformer3DModel: Wan's blocks with its own RoPE (an image edit is 2 frames: the flat tokens
# are split, balanced to one token); an image embedding joins the text, which stays whole.
CHRONOEDIT_PLAN: dict[str, Any] = {
    "rope": Split("out", "O L P K", shard="L"),
    "blocks.0": Split("hidden_states", "B L D", shard="L"),
    "blocks.*": Block("B L D", arg="hidden_states"),
    "blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}

# diffusers' AnyFlowTransformer3DModel: Wan's backbone with a source and a target timestep per frame, so the blocks'
# modulation is per token [B, L, 6, D] and follows the tokens; the RoPE is {"query": t, "key": t}, complex tables
# [1, 1, L, K] split with them. Gathered before norm_out (the model modulates with its own per-token embedding).
ANYFLOW_PLAN: dict[str, Any] = {
    "rope": Split("out", "O P L K", shard="L"),
    "blocks.0": Split("hidden_states", "B L D", shard="L"),
    "blocks.*": Block("B L D", arg="hidden_states", follow={"temb": "B L"}),
    "blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}


def _new_tokens(value: int, start: int, stop: int, total: int) -> int:
    """How many of this rank's tokens ``[start, stop)`` are among the last ``value`` of ``total``."""
    return max(0, stop - max(start, total - value))


# diffusers' HeliosTransformer3DModel: Wan's blocks over the history tokens (short, mid, long: packed before the new
# frames) and the new ones, per-token modulation and RoPE (following the tokens). Its blocks take
# original_context_length, the count of new tokens at the end of the sequence, to tell them from the history (history
# keys amplified, cross-attention for the new tokens only): on a shard, this rank's count of them. Gathered at
# norm_out, which keeps the new tokens.
HELIOS_PLAN: dict[str, Any] = {
    "blocks.0": Split("hidden_states", "B L D", shard="L"),
    "blocks.*": Block("B L D", arg="hidden_states", follow={"temb": "B L", "rotary_emb": "B L"},
                      local={"original_context_length": _new_tokens}),
    "blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}
