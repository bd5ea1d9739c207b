"""Built-in plans of diffusers 0.42.1's audio-video transformers: LTX-2, Kandinsky 6, MiniMax-H3.

LTX-2 and Kandinsky 6 run a video and an audio stream side by side in every block,
each attending itself, its text, and the other stream. The video tokens are split;
the audio stream, a few tokens next to thousands of video tokens, stays whole on
every rank: the audio queries that read the video (video-to-audio) read its keys
gathered, with a reduce-scatter backward (the audio stream's gradient differs by
rank: each rank's video queries read it).
MiniMax-H3 packs text, video and audio rows into one sequence, which is split as one.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.spec import Block, Gather, Heads, Split

__all__ = ["MINIMAX_H3_PLAN", "kandinsky6_plan", "ltx2_plan"]


def ltx2_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``LTX2VideoTransformer3DModel``: the video tokens split at the first block with their RoPE, video
    self-attention through the head switch; its modulations per token (a timestep per token, the cross-modal ones
    taken from it) follow the tokens. Audio self-attention and audio-to-text run whole on every rank as in one
    process; audio-to-video (video queries) runs on the video shard with its own slice of the video's cross-modal
    RoPE; video-to-audio (audio queries) reads every video key, gathered. The RoPE's layout follows ``rope_type``
    (interleaved ``[B, L, K]``, split ``[B, H, L, K]``)."""
    split = model.config.rope_type == "split"
    rope, cross_rope = ("B Hr L Kr", "B Hc L Kc") if split else ("B L Kr", "B L Kc")
    return {
        "rope": Split("out", rope, shard="L"),
        "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
        "transformer_blocks.*": Block("B L D", arg="hidden_states", follow={
            "temb": "B L", "temb_ca_scale_shift": "B L", "temb_ca_gate": "B L"}),
        "transformer_blocks.*.attn1": Heads(),
        "transformer_blocks.*.audio_to_video_attn": Split("query_rotary_emb", cross_rope, shard="L"),
        "transformer_blocks.*.video_to_audio_attn": Gather("encoder_hidden_states", "B L D", partial_grad=True),
        "norm_out": Gather(0, "B L D"),
    }


# diffusers' MiniMaxH3Transformer3DModel: text, video and audio rows packed by index into one sequence [B, S, D]
# before the blocks (so it is split at the first block, after the packing), one AdaLN row per packed row
# (adaln_indices [S] follows the rows), its RoPE [S, K] split with them; gathered before norm_out, which the
# model modulates per row and after which it picks the video and audio rows by index.
MINIMAX_H3_PLAN: dict[str, Any] = {
    "rope": Split("out", "L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states", follow={"adaln_indices": "L"}),
    "transformer_blocks.*.attn": Heads(),
    "norm_out": Gather(0, "B L D"),
}


def kandinsky6_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``Kandinsky6Transformer3DModel``: its text blocks whole on every rank; the video tokens ``[B, L, D]``
    split at the first fused block, video self-attention through the head switch with its slice of the RoPE
    ``[L, 1, K, 2, 2]`` (split where each attention takes it: audio-to-video's video queries take their slice too,
    video-to-audio's video keys the whole table), video-to-audio's video input gathered; the last fused block's video
    output gathered (the model unflattens it with the global shape next), its audio output passed as it is."""
    last = len(model.visual_transformer_blocks) - 1
    rope = "L Oa Kr Pa Qa"
    return {
        "visual_transformer_blocks.0": Split("vis", "B L D", shard="L"),
        "visual_transformer_blocks.*": Block("B L D", arg="vis"),
        "visual_transformer_blocks.*.video_dec_block.self_attention": [Split("rotary_emb", rope, shard="L"), Heads()],
        "visual_transformer_blocks.*.va_cross_attention": Split("rope_q", rope, shard="L"),
        "visual_transformer_blocks.*.av_cross_attention": Gather("encoder_hidden_states", "B L D", partial_grad=True),
        f"visual_transformer_blocks.{last}": Gather("out", "B L D"),
    }
