"""The video transformers of diffusers 0.42.1 with no built-in plan, each refused at ``parallelize`` naming why.

``parallelize(model)`` on one of these raises ``ValueError`` before any hook or
collective, saying what in the model no plan of this release serves; a plan of one's
own (``plan=``) is still taken. docs/models.md lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["REFUSED"]

_WHY = {
    "Cosmos3OmniTransformer": (
        "its attention module runs two pathways in one call on a packed sequence with no batch dim: the text prefix "
        "attends itself causally through one set of projections, and the vision, sound and action tokens attend the "
        "text and themselves through another (queries of the generated tokens only, keys of both, grouped K/V "
        "heads). The head switch takes one sequence of queries and keys; here the generated queries would need the "
        "text keys of the same heads on every rank (diffusers leaves it out of _cp_plan too)"),
    "SanaWMTransformer3DModel": (
        "its attention is a bidirectional gated delta rule (a chunked recurrence along the sequence, per head) with "
        "camera-ray transforms (UCPE) applied inside modules that are not diffusers attention modules; its "
        "projections' head switch (Heads(qkv=...)) is not verified against it in this release"),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "its self-attention reads a sliding-window KV cache the caller carries across autoregressive blocks (every "
        "head of the refined history): on the head shard a rank would need its heads of that cache, which the cache "
        "object holds whole"),
    "AnyFlowFARTransformer3DModel": (
        "its causal paths attend through flex attention with a BlockMask padded to 128 tokens inside the processor "
        "and, for inference, a KV cache of every head the caller carries across chunks; the training path's head "
        "switch at its projections (Heads(qkv=...)) is not verified in this release (no flex backward on CPU to "
        "check it against)"),
    "Kandinsky6SRTransformer3DModel": (
        "its NABLA attention builds its block mask inside the processor from the statistics of every query and key "
        "(means over 64-token blocks) and runs it through flex attention only; the head switch at its projections "
        "(Heads(qkv=...)) is not verified in this release (no flex backward on CPU to check it against)"),
    "WanAnimate2Transformer3DModel": (
        "its forward takes lists of samples and a KV cache of reference tokens written in one pass (kv_cache_mode="
        "'extract') and read in the next ('cached'), with a block mask built for the whole video (origin_len); the "
        "cache holds every head of the reference tokens, which a rank on the head shard would need its part of"),
}


def _refuse(name: str, why: str) -> Callable[[Any], dict[str, Any]]:
    def plan(model: Any) -> dict[str, Any]:
        raise ValueError(f"parallelize: no built-in plan for {name}: {why}. Pass plan= of your own for a use that "
                         f"avoids this (docs/models.md, 'a plan for your own model')")

    return plan


REFUSED: dict[str, Callable[[Any], dict[str, Any]]] = {name: _refuse(name, why) for name, why in _WHY.items()}
