"""torch.compile of the primitives (issue 28 item 1): split -> dynamic_switch -> gather on 2 gloo ranks
compiles to ONE graph (``fullgraph=True``: no break), ``dynamic=False`` and ``dynamic=True``, and its outputs
and gradients are the eager path's bit for bit, with ``comm_dtype="fp8"`` too (the FP8 payload's encode, one
functional all-to-all of its ``uint8`` bytes and its decode, forward and backward). The traced path's
functional collectives are what the accounting counts, with the eager path's bytes. (Host syncs in compiled
models: ``tests/test_compile_models.py``.)
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed


def _chain(x: torch.Tensor) -> torch.Tensor:
    from dsp_plugin.comm import dynamic_switch, gather, split

    s = split(x, 1)                                                  # R -> S(1), 7 rows: uneven on 2 ranks
    y = dynamic_switch(s * 2, 1, 2, global_len=x.shape[1])           # S(1) -> S(2)
    return gather(y * y, 2, global_len=x.shape[2])                   # S(2) -> R


def _chain_fp8(x: torch.Tensor) -> torch.Tensor:
    from dsp_plugin.comm import dynamic_switch, gather, split

    s = split(x, 1)
    y = dynamic_switch(s * 2, 1, 2, global_len=x.shape[1], comm_dtype="fp8")   # FP8 forward and backward
    return gather(y * y, 2, global_len=x.shape[2])


def _worker(rank: int, n: int, dynamic: bool) -> dict[str, object]:
    import torch._dynamo as dynamo
    import torch.distributed as dist

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import dynamic_switch, split, traced

    x = torch.randn(2, 7, 5, 3, generator=torch.Generator().manual_seed(0))
    eager_x = x.clone().requires_grad_(True)
    eager = _chain(eager_x)
    eager.square().sum().backward()
    explained = dynamo.explain(_chain)(x.clone())
    dynamo.reset()
    compiled_x = x.clone().requires_grad_(True)
    compiled = torch.compile(_chain, backend="aot_eager", fullgraph=True, dynamic=dynamic)(compiled_x)
    compiled.square().sum().backward()
    # the traced switch, run eagerly under the accounting (a dispatch mode is not traced by dynamo): the
    # functional all-to-all is counted, with the bytes of the eager c10d all-to-all
    shard = split(x, 1).detach()
    counted = {}
    for name, fn in (("c10d", lambda t: dynamic_switch(t, 1, 2, global_len=7)),
                     ("functional", lambda t: traced.traced_switch(t, 1, 2, 7, dist.group.WORLD, n, rank))):
        t = shard.clone().requires_grad_(True)
        with CommAccounting(activations=False) as acct:
            fn(t).sum().backward()
        counted[name] = [(r.op, r.phase, r.bytes_sent, r.bytes_received) for r in acct.records]
        counted[name + "_sources"] = sorted({r.source for r in acct.records})
    # the FP8 payload: encode, one functional all-to-all of the uint8 bytes, decode; the same bytes as eager's
    eager_x8 = x.clone().requires_grad_(True)
    eager8 = _chain_fp8(eager_x8)
    eager8.square().sum().backward()
    dynamo.reset()
    x8 = x.clone().requires_grad_(True)
    compiled8 = torch.compile(_chain_fp8, backend="aot_eager", fullgraph=True, dynamic=dynamic)(x8)
    compiled8.square().sum().backward()
    return {"fp8_out": torch.equal(compiled8, eager8), "fp8_grad": torch.equal(x8.grad, eager_x8.grad),
            "fp8_is_lossy": not torch.equal(eager8, eager),
            "breaks": explained.graph_break_count, "graphs": explained.graph_count,
            "reasons": [str(b.reason)[:200] for b in explained.break_reasons],
            "out": torch.equal(compiled, eager), "grad": torch.equal(compiled_x.grad, eager_x.grad), **counted}


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_primitives_one_graph_equal_eager(dynamic: bool) -> None:
    for rank, d in enumerate(run_distributed(_worker, 2, dynamic, timeout=600)):
        print(f"dynamic={dynamic} rank {rank}: {d}")
        assert (d["breaks"], d["graphs"]) == (0, 1), d
        assert d["out"] and d["grad"], d
        assert d["fp8_out"] and d["fp8_grad"] and d["fp8_is_lossy"], d   # compiled FP8 == eager FP8, bit for bit
        assert d["functional"] == d["c10d"] and len(d["c10d"]) == 2, d
        assert d["functional_sources"] == ["_c10d_functional.all_to_all_single"], d
