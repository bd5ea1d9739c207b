"""Built-in plans of the factorized models: Latte, SVD's spatio-temporal transformer, the reference STDiT.

Their blocks attend along one sequence axis at a time; the plans keep each
block's activation sharded on an axis it does not mix and switch between blocks.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.frames import OnShard
from dsp_plugin.plan.schedule import switch_schedule
from dsp_plugin.plan.spec import Block, Gather, Grid, Split

__all__ = ["LATTE_PLAN", "SVD_PLAN", "stdit_plan", "stdit_schedule"]


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

