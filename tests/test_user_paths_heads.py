"""``to_heads`` / ``from_heads`` called the ways users call them (issue 25's matrix, head-switch family).

One 4-rank spawn over the group styles of ``tests.user_paths`` (explicit groups with and without a
topology, a world topology, DSP=2 x DP=2): the API example's attention (4 query heads, 2 K/V heads,
10 tokens: uneven on 4 ranks) through the head switch equals the same attention on one process
(forward, and the input gradient summed over the group), fp64. The kernel between the switches is
the user's (``KERNELS``): PyTorch's SDPA with ``enable_gqa``, or a kernel that calls no SDPA and knows
no GQA (``tests.test_heads_backends.plain_attention`` on K/V heads repeated to the query heads).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.user_paths import STYLES, GroupStyles, sum_over

KERNELS = ("sdpa", "plain")


def _kernel(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over ``[B, S, H, Dh]`` (K/V with fewer heads: GQA)."""
    if kind == "sdpa":
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True)
        return o.transpose(1, 2)
    from tests.test_heads_backends import plain_attention

    repeat = q.shape[2] // max(k.shape[2], 1)
    return plain_attention(q, k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2))


def _attention(x: torch.Tensor, w_q: torch.Tensor, w_kv: torch.Tensor, group: Any, parallel: bool,
               kernel: str) -> torch.Tensor:
    from dsp_plugin import from_heads, to_heads

    q = (x @ w_q).unflatten(-1, (4, 8))                                  # [B, S_local, H, Dh]
    k, v = (x @ w_kv).unflatten(-1, (2, 2, 8)).unbind(2)                 # [B, S_local, H_kv, Dh]
    if parallel:
        q, k, v = to_heads(q, k, v, seq_dim=1, head_dim=2, group=group, global_len=10)
    o = _kernel(kernel, q, k, v)
    return from_heads(o, seq_dim=1, head_dim=2, group=group, heads=4, global_len=10) if parallel else o


def _worker(rank: int, world_size: int, kernel: str) -> dict[str, Any]:
    from dsp_plugin import gather, split

    torch.set_default_dtype(torch.float64)
    styles = GroupStyles()
    out: dict[str, Any] = {}
    for name in STYLES:
        style = styles.enter(name)
        g = torch.Generator().manual_seed(style.batch_seed)
        x = torch.randn(2, 10, 32, generator=g)
        w_q, w_kv = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
        x_ref = x.clone().requires_grad_(True)
        ref = _attention(x_ref, w_q, w_kv, None, parallel=False, kernel=kernel)
        ref.square().mean().backward()
        try:
            x_par = x.clone().requires_grad_(True)
            shard = split(x_par, 1, group=style.group)
            attended = _attention(shard, w_q, w_kv, style.group, parallel=True, kernel=kernel)
            result = gather(attended, 1, group=style.group, global_len=10)
            result.square().mean().backward()
        except Exception as exc:  # noqa: BLE001 - reported per cell
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        # split's backward gathers: every rank holds the full input gradient, with 1/N of the loss each
        out[name] = {"out": (result - ref).abs().max().item(),
                     "dx": (sum_over(x_par.grad, style.dsp_group) / dist_size(style.dsp_group) - x_ref.grad)
                     .abs().max().item()}
    return out


def dist_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_switch_every_group_style_equals_one_process(kernel: str) -> None:
    failures = []
    for rank, cells in enumerate(run_distributed(_worker, 4, kernel)):
        for name, d in cells.items():
            print(f"rank {rank} {name}: {d}")
            if isinstance(d, str) or max(d.values()) > 1e-12:
                failures.append(f"rank {rank} {name}: {d}")
    assert not failures, "\n".join(failures)
