"""Built-in plans, found from the model's class name (or its ``_dsp_plan`` attribute).

Each plan is the whole of what DSP needs to know about the model; the line count
of each is reported in docs/models.md.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.frames import OnShard
from dsp_plugin.plan.schedule import switch_schedule
from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

__all__ = ["COGVIDEOX_PLAN", "LATTE_PLAN", "SVD_PLAN", "WAN_PLAN", "builtin_plan", "stdit_plan", "stdit_schedule"]


def _latte_temporal_positions(model: Any, x: Any, grid: dict[str, int], local: dict[str, int]) -> Any:
    """Latte adds ``temp_pos_embed`` before its first temporal block only ``if num_frame > 1``, with
    ``num_frame`` read from its input: fed one frame of a longer video, a rank skips it. Add it there."""
    return x + model.temp_pos_embed.to(x.dtype) if local["T"] == 1 < grid["T"] else x


# diffusers' LatteTransformer3DModel: spatial blocks on [B*T, S, D], temporal blocks on [B*S, T, D], the model
# reshaping between them inline with its own B. Shard the folded rows: the frames (T) for spatial blocks, the
# patches (S) for temporal blocks; each block's output leaves with the placement the next reshape needs.
LATTE_PLAN: dict[str, Any] = {
    "": Grid(B=("hidden_states", 0)),
    "pos_embed": Split("out", "(B T) S D", shard="T"),
    "transformer_blocks.*": Block("(B T) S D", attends="S", then="T", out_shard="S",
                                  follow={"encoder_hidden_states": "(B T)", "timestep": "(B T)"}),
    "temporal_transformer_blocks.*": Block("(B S) T D", attends="T", then="S", out_shard="T",
                                           follow={"timestep": "(B S)"}),
    "temporal_transformer_blocks.0": OnShard(0, _latte_temporal_positions),
    "norm_out": Gather(0, "(B T) S D"),
}

# SVD's TransformerSpatioTemporalModel: every block on [B*F, S, D]; the temporal block folds itself into
# [B*S, F, D] with the num_frames argument, so it runs on the patches' shard with F whole. Split the frames after
# proj_in, switch to patches after each spatial block (the frame embedding, the temporal block, its frame-0 text
# context and the time mixer are per pixel) and back before the next; gather before proj_out, whose reshape and
# residual need every pixel. The frame-0 context is built by the model from the replicated input.
SVD_PLAN: dict[str, Any] = {
    "": Grid(F=("image_only_indicator", 1)),
    "proj_in": Split("out", "(B F) S D", shard="F"),
    "transformer_blocks.*": Block("(B F) S D", attends="S", then="F", out_shard="S",
                                  follow={"encoder_hidden_states": "(B F)"}),
    "temporal_transformer_blocks.*": Block("(B F) S D", attends="F", follow={"encoder_hidden_states": "(B S)"}),
    "proj_out": Gather(0, "(B F) S D"),
}

# diffusers' WanTransformer3DModel: full 3D attention over the flattened [B, F*H*W, D] tokens (patch size 1 in
# time). Shard whole frames of tokens at the first block (3D RoPE is computed for the global grid and split the
# same way), self-attention through the head switch, text cross-attention local; gather after the output
# projection. Whole frames keep the latents [B, C, F, H, W] shardable on F for sampling (sharded_io).
WAN_PLAN: dict[str, Any] = {
    "": Grid(F=("hidden_states", 2)),
    "rope": [Positions("hidden_states", {2: "F"}), Split("out", "O (F HW) P Dr", shard="F")],
    "blocks.0": Split("hidden_states", "B (F HW) D", shard="F"),
    "blocks.*": Block("B (F HW) D", arg="hidden_states"),
    "blocks.*.attn1": Heads(),
    "proj_out": Gather("out", "B (F HW) D"),
}

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


def _stdit_blocks(model: Any) -> tuple[tuple[str, ...], list[tuple[str, tuple[int, int] | None]]]:
    axes = ("T", "S") if model.config.axes == 2 else ("T", "H", "W")
    attend = [block.attend_dim for block in model.blocks]
    schedule, _ = switch_schedule(attend, model.sequence_dims, first_shard=1)
    return axes, [(axes[a - 1], switch) for a, switch in zip(attend, schedule)]


def stdit_plan(model: Any) -> dict[str, Any]:
    """The reference STDiT: latents split on frames before the (per-frame) embedder, blocks on
    ``[B, T, S, D]`` (or ``[B, T, H, W, D]``) switching only before a block that attends the sharded axis,
    to the axis whose next use is furthest (``switch_schedule``, compiled once); gather before unpatchify."""
    axes, blocks = _stdit_blocks(model)
    lay = "B " + " ".join(axes) + " D"
    plan: dict[str, Any] = {"embedder": Split(0, "B C T Hp Wp", shard="T"), "unpatchify": Gather(0, lay)}
    for i, (attends, switch) in enumerate(blocks):
        plan[f"blocks.{i}"] = Block(lay, arg="x", attends=attends, then=axes[switch[1] - 1] if switch else None)
    return plan


def stdit_schedule(model: Any) -> list[str]:
    """What ``stdit_plan`` does before each block, one line each (for logs): local, or the switch."""
    axes, blocks = _stdit_blocks(model)
    return [f"blocks.{i} (attends {attends}): " + (f"switch {axes[s[0] - 1]} -> {axes[s[1] - 1]}" if s else "local")
            for i, (attends, s) in enumerate(blocks)]


_BY_CLASS = {"LatteTransformer3DModel": LATTE_PLAN, "TransformerSpatioTemporalModel": SVD_PLAN,
             "WanTransformer3DModel": WAN_PLAN, "CogVideoXTransformer3DModel": COGVIDEOX_PLAN, "STDiT": stdit_plan}


def builtin_plan(model: Any) -> Any:
    """The plan for ``model``: its ``_dsp_plan``, else the built-in one for its class, else None."""
    own = getattr(model, "_dsp_plan", None)
    if own is not None:
        return own
    for cls in type(model).__mro__:
        if cls.__name__ in _BY_CLASS:
            plan = _BY_CLASS[cls.__name__]
            return plan(model) if callable(plan) else plan
    return None
