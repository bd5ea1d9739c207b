"""Built-in plans of diffusers 0.42.1's video transformers with linear attention: SanaVideo.

SanaVideo's self-attention is linear attention written out in its processor (``relu``
features, two matmuls over every token, per head): no kernel the head switch sees. It
is per head, so it runs on the head shard as softmax attention does: q, k, v switch
where they leave their projections (after the norm across heads) and the output
before ``to_out`` (``Heads(qkv=..., out=...)``, ``plan/projections.py``). Its RoPE is
applied after that switch, on every token: it stays whole.
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.spec import Block, Gather, Grid, Heads, Split

__all__ = ["sana_video_plan"]

_FRAMES = "B (F HW) D"


def sana_video_plan(model: Any) -> dict[str, Any]:
    """diffusers' ``SanaVideoTransformer3DModel``: whole frames of tokens split at the first block (its feed-forward
    unflattens them into ``frames``, an int each block is given: this rank's count), linear self-attention on the
    head shard, text cross-attention per token; the feed-forward's temporal convolution (3 frames) runs after a
    switch to the patches and back (its spatial 3x3 convolution needs every patch of a frame, which whole frames
    give). Gathered at norm_out."""
    attn = model.transformer_blocks[0].attn1
    q, k = ("norm_q" if attn.norm_q is not None else "to_q"), ("norm_k" if attn.norm_k is not None else "to_k")
    return {
        "": Grid(F=("hidden_states", 2)),
        "transformer_blocks.0": Split("hidden_states", _FRAMES, shard="F"),
        "transformer_blocks.*": Block(_FRAMES, arg="hidden_states", follow={"timestep": "B (F HW)"},
                                      local={"frames": "F"}),
        "transformer_blocks.*.attn1": Heads(qkv=(q, k, "to_v"), out="to_out.0"),
        "transformer_blocks.*.ff.conv_temp": Block("B Dt F HW", attends="F", then="HW", out_shard="F"),
        "norm_out": Gather(0, _FRAMES),
    }
