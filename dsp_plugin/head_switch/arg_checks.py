"""What a valid head-switch call is (``dsp_plugin.head_switch``): the argument checks made before the exchange.

Each raises a ``TypeError`` / ``ValueError`` naming the value and what was
expected; ``to_heads`` / ``from_heads`` carry it to every rank through the
cross-rank check (``dsp_plugin.checks``), so no peer waits in a collective.
"""

from __future__ import annotations

import torch

from dsp_plugin import layout
from dsp_plugin.comm import agree

__all__ = ["check_qkv", "check_replicated"]


def check_qkv(q: object, k: object, v: object, seq_dim: object, head_dim: object) -> tuple[int, int, int]:
    """(seq dim, head dim, K/V heads) of a valid call; a TypeError/ValueError naming the value otherwise."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"to_heads: {name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not q.dim() == k.dim() == v.dim() or q.dim() < 2:
        raise ValueError(f"to_heads: q, k, v have {q.dim()}, {k.dim()}, {v.dim()} dims; expected the same "
                         f"number, at least 2 (a sequence dim and a head dim)")
    seq = agree._normalize_dim("to_heads", "seq_dim", seq_dim, q.dim())
    head = agree._normalize_dim("to_heads", "head_dim", head_dim, q.dim())
    if seq == head:
        raise ValueError(f"to_heads: seq_dim={seq_dim} and head_dim={head_dim} are both dim {seq}; "
                         f"expected two different dims")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"to_heads: q, k, v are {q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}; "
                         f"expected one dtype and one device")
    heads, kv_heads = q.shape[head], k.shape[head]
    if v.shape[head] != kv_heads or kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise ValueError(f"to_heads: q, k, v have {heads}, {kv_heads}, {v.shape[head]} heads (dim {head}); "
                         f"expected k and v alike, with a head count >= 1 that divides q's (MHA: equal; GQA/MQA: "
                         f"fewer)")
    for d in range(q.dim()):
        if d != head and (d != q.dim() - 1 or d == seq) and not q.shape[d] == k.shape[d] == v.shape[d]:
            raise ValueError(f"to_heads: dim {d} is {q.shape[d]} in q, {k.shape[d]} in k, {v.shape[d]} in v; "
                             f"expected the same (only the head dim {head} and the head size, the last dim, "
                             f"may differ)")
    spec = layout.shard_spec(q)
    if spec is not None and spec.dim == seq and len(spec.grid) > 1:
        raise ValueError(f"to_heads: q's dim {seq} folds the sequence axes {spec.grid} ({spec}); expected one "
                         f"sequence axis: unflatten the dim into its grid first and pass the sharded axis as "
                         f"seq_dim (the other axes are whole on every rank)")
    return seq, head, kv_heads


def check_replicated(name: str, replicated: object, partners: tuple[torch.Tensor, ...], seq: int,
                      head: int) -> tuple[torch.Tensor, ...]:
    """The replicated tokens' tensors, one per partner, each ``[.., R, .., heads, ..]`` like its partner."""
    names = ("q", "k", "v")[:len(partners)] if len(partners) > 1 else ("out",)
    if not isinstance(replicated, (tuple, list)) or len(replicated) != len(partners):
        raise TypeError(f"{name}: replicated={type(replicated).__name__}; expected {len(partners)} tensors, "
                        f"the replicated tokens of {', '.join(names)}")
    for label, t, partner in zip(names, replicated, partners):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: the replicated {label} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dim() != partner.dim() or t.dtype != partner.dtype or t.device != partner.device:
            raise ValueError(f"{name}: the replicated {label} is {tuple(t.shape)} {t.dtype}/{t.device}, its shard "
                             f"{tuple(partner.shape)} {partner.dtype}/{partner.device}; expected as many dims, one "
                             f"dtype and one device")
        bad = [d for d in range(t.dim()) if d != seq and t.shape[d] != partner.shape[d]
               and (d == head or d == t.dim() - 1 or t.shape[d] != 1)]
        if bad:
            raise ValueError(f"{name}: the replicated {label} has shape {tuple(t.shape)}, its shard "
                             f"{tuple(partner.shape)}; expected the same heads (dim {head}) and head size, other "
                             f"dims equal or 1 (sequence axes folded with the sharded one), any token count on dim "
                             f"{seq}")
    if len({t.shape[seq] for t in replicated}) != 1:
        raise ValueError(f"{name}: the replicated q, k, v hold {[t.shape[seq] for t in replicated]} tokens on "
                         f"dim {seq}; expected the same count")
    return tuple(replicated)
