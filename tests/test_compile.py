"""torch.compile of the primitives (issue 28 item 1): split -> dynamic_switch -> gather on 2 gloo ranks
compiles to ONE graph (``fullgraph=True``: no break), ``dynamic=False`` and ``dynamic=True``, and its outputs
and gradients are the eager path's bit for bit, with ``comm_dtype="fp8"`` too (the FP8 payload's encode, one
functional all-to-all of its ``uint8`` bytes and its decode, forward and backward). The traced path's
functional collectives are what the accounting counts, with the eager path's bytes. The head switch with the
FP8 payload likewise (issue 28, item 1's leftover): ``to_heads`` (GQA, K kept exact, joint text replicated)
and ``from_heads`` (the text's output in the same all-to-all) compile to one graph whose four ``uint8``
all-to-alls (forward and backward) send eager's bytes, outputs and gradients eager's bit for bit, no host
sync. (Host syncs in compiled models: ``tests/test_compile_models.py``.)
"""

from __future__ import annotations

import contextlib

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


def _heads_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor,
               v_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from dsp_plugin.comm import split
    from dsp_plugin.head_switch import from_heads, to_heads

    local = [split(t, 1) for t in (q, k, v)]                             # 7 tokens: uneven on 2 ranks
    hq, hk, hv, tq, tk, tv = to_heads(*local, seq_dim=1, head_dim=2, global_len=q.shape[1], comm_dtype="fp8",
                                      exact=("k",), replicated=(q_t, k_t, v_t))   # q, v in FP8, K in bf16
    return from_heads(hq * hk + hv, seq_dim=1, head_dim=2, heads=q.shape[2], global_len=q.shape[1],
                      replicated=tq * tk + tv, comm_dtype="fp8")          # out and the text's out in FP8


def _heads_worker(rank: int, n: int, dynamic: bool) -> dict[str, object]:
    import torch._dynamo as dynamo
    from torch._dynamo.backends.debugging import ExplainWithBackend

    from dsp_plugin.accounting import CommAccounting
    from tests.test_compile_models import HostSyncs

    g = torch.Generator().manual_seed(0)
    # q [B, S, H, D], GQA k/v with 2 of 4 heads, K on another scale; 2 joint-text tokens on every rank
    shapes = [(2, 7, 4, 3), (2, 7, 2, 3), (2, 7, 2, 3), (2, 2, 4, 3), (2, 2, 2, 3), (2, 2, 2, 3)]
    xs = [torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in shapes]
    xs[1] = xs[1] * 100

    def step(fn, counted: bool = False):  # type: ignore[no-untyped-def]
        ins = [x.clone().requires_grad_(True) for x in xs]
        acct = CommAccounting(activations=False)
        with acct if counted else contextlib.nullcontext():   # eager only: a dispatch mode makes dynamo skip frames
            out, out_t = fn(*ins)
            (out.float().square().sum() + out_t.float().square().sum()).backward()
        sent = [(r.phase, r.bytes_sent) for r in acct.records if r.op == "all_to_all"] if counted else []
        return [out.detach(), out_t.detach(), *(t.grad for t in ins)], sent

    eager, eager_sent = step(_heads_fp8, counted=True)
    plain, _ = step(_plain)
    explained = None
    if not dynamic:  # without fullgraph and without a gradient (inference: no autograd Function) no break either
        with torch.no_grad():
            explained = dynamo.explain(_heads_fp8)(*xs)
        dynamo.reset()
    explain = ExplainWithBackend("aot_eager")
    compiled_fn = torch.compile(_heads_fp8, backend=explain, fullgraph=True, dynamic=dynamic)
    step(compiled_fn)
    with HostSyncs() as syncs:
        compiled, _ = step(compiled_fn)
    graphs = explain.output().graphs
    # the all-to-alls are inside the autograd Function's forward and backward bodies (subgraphs)
    sent = [[str(s) for s in node.args[2]] + [str(node.args[0].meta["example_value"].dtype)]
            for graph in graphs for module in graph.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if "all_to_all_single" in str(node.target)]
    return {"graphs": len(graphs), "explain": explained and (explained.graph_count, explained.graph_break_count),
            "equal": [bool(torch.equal(a, b)) for a, b in zip(compiled, eager)],
            "lossy": not all(torch.equal(a, b) for a, b in zip(eager[:2], plain[:2])),
            "host_syncs": syncs.count, "compiled_sent": sent, "eager_sent": eager_sent}


def _plain(*ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_heads_fp8`` without the payload: the FP8 one must differ from it."""
    from dsp_plugin.comm import split
    from dsp_plugin.head_switch import from_heads, to_heads

    q, k, v, q_t, k_t, v_t = ts
    hq, hk, hv, tq, tk, tv = to_heads(*(split(t, 1) for t in (q, k, v)), seq_dim=1, head_dim=2,
                                      global_len=q.shape[1], replicated=(q_t, k_t, v_t))
    return from_heads(hq * hk + hv, seq_dim=1, head_dim=2, heads=q.shape[2], replicated=tq * tk + tv)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_fp8_head_switch_equals_eager(dynamic: bool) -> None:
    for rank, d in enumerate(run_distributed(_heads_worker, 2, dynamic, timeout=600)):
        print(f"dynamic={dynamic} rank {rank}: {d}")
        assert d["graphs"] == 1 and d["explain"] in ((1, 0), None), d     # fullgraph; no break without it either
        assert all(d["equal"]) and len(d["equal"]) == 8 and d["lossy"], d   # out, text out, 6 input gradients
        assert d["host_syncs"] == 0, d
        # to_heads, from_heads forward; their adjoints backward: 4 all-to-alls of uint8, each eager's bytes
        assert [c[-1] for c in d["compiled_sent"]] == ["torch.uint8"] * 4, d
        if not dynamic:   # dynamic=True: the split sizes are symbols
            assert sorted(sum(int(s) for s in c[:-1]) for c in d["compiled_sent"]) == \
                sorted(b for _, b in d["eager_sent"]), d
