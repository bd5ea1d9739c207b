"""Built-in plans of video DiTs with joint attention over [text, video] tokens: CogVideoX, ConsisID, EasyAnimate,
HunyuanVideo, Framepack, Mochi.

The video tokens are split at the first block; the text stream, which belongs to no
position, stays whole on every rank and joins each attention as replicated tokens
(``Heads(joint=...)``: its output comes back inside the all-to-all that returns the
video tokens, 2 all-to-alls per attention). Text masks are built by the models for
the global sequence, so the video is split after the code that sizes them.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

__all__ = ["COGVIDEOX_PLAN", "EASYANIMATE_PLAN", "HUNYUAN_VIDEO_FRAMES_PLAN", "HUNYUAN_VIDEO_PLAN", "MOCHI_PLAN",
           "consisid_plan", "framepack_plan", "hunyuan_video_frames_plan", "hunyuan_video_plan"]

# diffusers' CogVideoXTransformer3DModel: joint full attention over [text, video] (the processor concatenates the
# text first). Split the flat video tokens at the first block (a flat split also fits CogVideoX 1.5's frames folded
# by patch_size_t); the text stream stays whole on every rank (Heads(joint="first")); the 3D RoPE tables, a
# (cos, sin) pair for the global video tokens passed in by the pipeline, split the same way (absent: left out);
# gather before the final norm, after which the model unpatchifies with its global frame count.
COGVIDEOX_PLAN: dict[str, Any] = {
    "": Split("image_rotary_emb", "L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(joint="first"),
    "norm_final": Gather(0, "B L D"),
}


def consisid_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``ConsisIDTransformer3DModel``: CogVideoX's blocks, whose last output is gathered (the model
    concatenates the text back before ``norm_final``). The identity path's perceiver cross-attention after a block
    takes per-token queries, so it runs on the shard."""
    return {
        "": Split("image_rotary_emb", "L K", shard="L"),
        "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
        "transformer_blocks.*": Block("B L D", arg="hidden_states"),
        "transformer_blocks.*.attn1": Heads(joint="first"),
        f"transformer_blocks.{len(model.transformer_blocks) - 1}": Gather("out", "B L D"),
    }


# diffusers' EasyAnimateTransformer3DModel: text (and T5 text) before the video tokens in every attention; 3D RoPE
# computed from the latents' shape for the global tokens.
EASYANIMATE_PLAN: dict[str, Any] = {
    "rope_embedding": Split("out", "L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(joint="first"),
    "norm_final": Gather(0, "B L D"),
}

# diffusers' HunyuanVideoTransformer3DModel: double-stream then single-stream blocks, text after the video tokens.
# The model builds its text key-padding mask [B, 1, 1, L + R] from the embedded tokens, so the video is split at
# the first block's input, after that; the mask reaches the head shard unchanged.
HUNYUAN_VIDEO_PLAN: dict[str, Any] = {
    "rope": Split("out", "L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "single_transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn": Heads(joint="last"),
    "single_transformer_blocks.*.attn": Heads(joint="last"),
    "norm_out": Gather(0, "B L D"),
}


# The same model fed whole frames: the tokens split B (F HW) D on F (whole frames) at the first block and gathered
# at norm_out, the 3D RoPE (cos, sin) split the same way. The sampler that keeps the latents [B, C, F, H, W]
# sharded on F across the loop (pipelines/hunyuan_sampler.py) calls the model under sharded_io: RoPE then sees the
# global shape (Positions), and the text key-padding mask the model builds from its frame shard (R + L_local keys)
# is laid out by gathering its video key columns (plan/masks.py). Not the default: the entry split refuses fewer
# latent frames than ranks (9 frames = 3 latent frames on 4 ranks, one frame on any N > 1), which the flat split
# above serves, and it balances to a frame, not a token (33 latent frames on 8 ranks: 5 on one, 4 on the rest).
HUNYUAN_VIDEO_FRAMES_PLAN: dict[str, Any] = {
    "": Grid(F=("hidden_states", 2)),
    "rope": [Positions("hidden_states", {2: "F"}), Split("out", "(F HW) K", shard="F")],
    "transformer_blocks.0": Split("hidden_states", "B (F HW) D", shard="F"),
    "transformer_blocks.*": Block("B (F HW) D", arg="hidden_states"),
    "single_transformer_blocks.*": Block("B (F HW) D", arg="hidden_states"),
    "transformer_blocks.*.attn": Heads(joint="last"),
    "single_transformer_blocks.*.attn": Heads(joint="last"),
    "norm_out": Gather(0, "B (F HW) D"),
}


def _refuse_token_replace(model: Any, entry: str) -> None:
    kind = getattr(model.config, "image_condition_type", None)
    if kind == "token_replace":
        raise ValueError(f"{entry}: HunyuanVideoTransformer3DModel with image_condition_type='token_replace' "
                         "modulates its blocks' first first_frame_num_tokens tokens by position; the built-in plan "
                         "splits the tokens, so every rank would treat its own first tokens as frame 0; expected "
                         "image_condition_type None or 'latent_concat'")


def hunyuan_video_plan(model: Any) -> dict[str, Any]:
    """``HUNYUAN_VIDEO_PLAN``, refused for ``image_condition_type="token_replace"`` (I2V), whose blocks modulate
    the first ``first_frame_num_tokens`` tokens of whatever they hold: on a shard, another rank's first tokens."""
    _refuse_token_replace(model, "parallelize")
    return HUNYUAN_VIDEO_PLAN


def hunyuan_video_frames_plan(model: Any) -> dict[str, Any]:
    """``HUNYUAN_VIDEO_FRAMES_PLAN`` (whole frames, for a model fed its frame shard), refused as
    ``hunyuan_video_plan`` refuses, and for ``patch_size_t`` > 1 (frames folded into a token)."""
    _refuse_token_replace(model, "parallelize")
    if model.config.patch_size_t != 1:
        raise ValueError(f"parallelize: HunyuanVideoTransformer3DModel with patch_size_t={model.config.patch_size_t} "
                         f"folds frames into a token; HUNYUAN_VIDEO_FRAMES_PLAN splits whole frames; expected "
                         f"patch_size_t=1, or hunyuan_video_plan (a flat token split)")
    return HUNYUAN_VIDEO_FRAMES_PLAN


def framepack_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``HunyuanVideoFramepackTransformer3DModel``: HunyuanVideo's blocks over the history tokens (4x,
    2x, clean) packed before the new frames. The model packs the RoPE tables with them, so each block splits its
    tables; the last block's output is gathered (the model keeps the last tokens, the new frames, after it). The
    key-padding mask it builds for batch > 1 covers the global sequence."""
    last = (f"single_transformer_blocks.{len(model.single_transformer_blocks) - 1}"
            if len(model.single_transformer_blocks) else f"transformer_blocks.{len(model.transformer_blocks) - 1}")
    return {
        "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
        "transformer_blocks.*": [Block("B L D", arg="hidden_states"), Split("freqs_cis", "L K", shard="L")],
        "single_transformer_blocks.*": [Block("B L D", arg="hidden_states"),
                                        Split("image_rotary_emb", "L K", shard="L")],
        "transformer_blocks.*.attn": Heads(joint="last"),
        "single_transformer_blocks.*.attn": Heads(joint="last"),
        last: Gather("out", "B L D"),
    }


# diffusers' MochiTransformer3DModel: its processor attends once per sample over that sample's valid text tokens
# (after the video tokens), so 2 all-to-alls per layer and sample.
MOCHI_PLAN: dict[str, Any] = {
    "rope": Split("out", "L Hr K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(joint="last"),
    "norm_out": Gather(0, "B L D"),
}
