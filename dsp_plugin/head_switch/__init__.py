"""The head switch: full attention over a sequence-sharded activation, ``S(seq) -> S(heads) -> S(seq)``.

``exchange`` holds the primitive (``to_heads``, ``from_heads``: one packed all-to-all each way, uneven
heads, more ranks than heads, GQA, replicated tokens as in joint attention) and the per-rank head
ranges; ``arg_checks`` what a valid call is, checked before the exchange. The plan hook that routes a
module's attention through it is ``dsp_plugin.plan.attention``.
"""

from __future__ import annotations

from dsp_plugin.head_switch.exchange import (
    from_heads,
    head_ranges,
    kv_elements_sent,
    kv_head_ranges,
    local_head_counts,
    to_heads,
)

__all__ = ["from_heads", "head_ranges", "kv_elements_sent", "kv_head_ranges", "local_head_counts", "to_heads"]
