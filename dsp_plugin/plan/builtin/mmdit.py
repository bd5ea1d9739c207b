"""Built-in plans of video DiTs whose double- and single-stream blocks join the text after the video tokens in
every attention (HunyuanVideo's layout): HunyuanVideo 1.5, Motif-Video.

The video tokens are split at the first block, the text stream stays whole on every
rank and joins each attention as replicated tokens (``Heads(joint="last")``), the
RoPE computed for the global tokens is split with them, and the tokens are gathered
before the output norm.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.spec import Block, Gather, Heads, Split

__all__ = ["HUNYUAN_VIDEO15_PLAN", "motif_video_plan"]

# diffusers' HunyuanVideo15Transformer3DModel: the text streams (an image embedding, ByT5's and the MLLM's, valid
# tokens first) are joined before the blocks; the attention processor builds its mask [B, 1, S, S] from the text
# mask and the tokens it is called with (S = R + this rank's tokens): a padding mask of both queries and keys, which
# the head switch lays out for the global sequence (plan/masks.py).
HUNYUAN_VIDEO15_PLAN: dict[str, Any] = {
    "rope": Split("out", "L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn": Heads(joint="last"),
    "norm_out": Gather(0, "B L D"),
}


def motif_video_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``MotifVideoTransformer3DModel``: dual- and single-stream blocks with the text (an image embedding
    before it) last, its key-padding mask built by the model for the global sequence, text cross-attention per
    token. With decoder layers (``num_decoder_layers`` > 0) the last single blocks attend the embedded input
    (split there) jointly with the encoder stream's output, gathered before them as their replicated tokens (a
    reduce-scatter backward: each rank reads it through its own heads)."""
    singles = len(model.single_transformer_blocks)
    decoders = model.config.num_decoder_layers
    first = "transformer_blocks.0" if len(model.transformer_blocks) else "single_transformer_blocks.0"
    plan: dict[str, Any] = {
        "rope": Split("out", "L K", shard="L"),
        first: Split("hidden_states", "B L D", shard="L"),
        "transformer_blocks.*": Block("B L D", arg="hidden_states"),
        "single_transformer_blocks.*": Block("B L D", arg="hidden_states"),
        "transformer_blocks.*.attn": Heads(joint="last"),
        "single_transformer_blocks.*.attn": Heads(joint="last"),
        "norm_out": Gather(0, "B L D"),
    }
    if decoders:
        plan[f"single_transformer_blocks.{singles - decoders}"] = [
            Gather("encoder_hidden_states", "B L D", partial_grad=True), Split("hidden_states", "B L D", shard="L")]
    return plan
