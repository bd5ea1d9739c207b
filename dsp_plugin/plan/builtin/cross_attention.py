"""Built-in plans of full-3D video DiTs whose text enters through cross-attention: Wan, SkyReels-V2, LTX-Video,
Allegro, Cosmos, Kandinsky 5.

The video tokens are split at the first block; self-attention runs through the head
switch (2 all-to-alls per layer); cross-attention to the text is per token and runs
locally; the tokens are gathered before the model's output stage. Positional tables
computed for the global tokens are split with them.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Positions, Split

__all__ = ["ALLEGRO_PLAN", "COSMOS_PLAN", "LTX_VIDEO_PLAN", "SKYREELS_V2_PLAN", "WAN_PLAN", "kandinsky5_plan"]

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

# diffusers' SkyReelsV2Transformer3DModel: Wan's blocks. The flat tokens are split (balanced to one token, any
# patch size); under diffusion forcing the per-token modulation [B, 6, L, D] follows them into every block (the
# per-sample [B, 6, D] is left whole), and causal blocks pass the block-causal mask, built by the model for the
# global tokens, to the head shard unchanged. Gathered before norm_out, whose per-token shift and scale (diffusion
# forcing) are the model's own, whole.
SKYREELS_V2_PLAN: dict[str, Any] = {
    "rope": Split("out", "O L P K", shard="L"),
    "blocks.0": Split("hidden_states", "B L D", shard="L"),
    "blocks.*": Block("B L D", arg="hidden_states", follow={"temb": "B J L K"}),
    "blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}

# diffusers' LTXVideoTransformer3DModel: patchified tokens in, RoPE [B, L, K] from the global grid. A timestep per
# token (LTXConditionPipeline's conditioning frames) makes the blocks' modulation [B, L, 6D]: it follows the tokens
# (the per-sample [B, 1, 6D] broadcasts and is left whole). Gathered before norm_out, after which the model
# modulates with its own per-token (or per-sample) embedding.
LTX_VIDEO_PLAN: dict[str, Any] = {
    "rope": Split("out", "B L K", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states", follow={"temb": "B L"}),
    "transformer_blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}

# diffusers' AllegroTransformer3DModel: the pipeline passes RoPE as ((cos, sin) per axis, positions per axis); the
# tables are indexed by position and stay whole, the three position rows [1, L] follow the tokens.
ALLEGRO_PLAN: dict[str, Any] = {
    "": Split(("image_rotary_emb", 1), "O L", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}

# diffusers' CosmosTransformer3DModel: RoPE [L, K] and learnable positions [B, L, D] computed for the global tokens,
# split with them at the first block. Cosmos 2's per-frame timestep makes the modulations per token [B, L, D]:
# they follow the tokens (the per-sample [B, D] has fewer dims than the layout and stays whole), as does a
# ControlNet's residual. Gathered at norm_out, which modulates with the model's own embeddings.
COSMOS_PLAN: dict[str, Any] = {
    "rope": Split("out", "L K", shard="L"),
    "learnable_pos_embed": Split("out", "B L D", shard="L"),
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states", follow={
        "embedded_timestep": "B L Dt", "temb": "B L Dt", "controlnet_residual": "B L Dc"}),
    "transformer_blocks.*.attn1": Heads(),
    "norm_out": Gather("hidden_states", "B L D"),
}


#: why ``kandinsky5_plan`` refuses ``sparse_params``
NABLA = ("NABLA sparse attention builds its flex BlockMask inside the processor from means of every 64 queries and "
         "keys of the sequence; on a rank's shard those are this rank's tokens only (a different mask, and a shape "
         "error against the global sta_mask); run Kandinsky 5 with dense attention (sparse_params=None) under DSP")


def kandinsky5_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``Kandinsky5Transformer3DModel``: the text blocks run whole on every rank; the visual tokens
    ``[B, L, D]`` are split at the first visual block, their RoPE ``[B, L, 1, K, 2, 2]`` follows them into every
    block, and the last visual block's output is gathered (the model unflattens it with the global shape next).
    NABLA sparse attention (``sparse_params``) is refused at every visual block's entry (``Block(refuse=...)``)."""
    last = len(model.visual_transformer_blocks) - 1
    return {
        "visual_transformer_blocks.0": Split("visual_embed", "B L D", shard="L"),
        "visual_transformer_blocks.*": Block("B L D", arg="visual_embed", follow={"rope": "B L"},
                                             refuse={"sparse_params": NABLA}),
        "visual_transformer_blocks.*.self_attention": Heads(),
        f"visual_transformer_blocks.{last}": Gather("out", "B L D"),
    }
