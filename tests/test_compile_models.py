"""torch.compile of plan-parallelized tiny models (issue 28 item 1): the reference STDiT (switches), the
tiny Wan (the head switch at diffusers' dispatch) and the tiny Latte (switches between its spatial and
temporal blocks, the cross-attention's text replicated) on 2 gloo ranks.

``torch._dynamo.explain`` counts the graphs: every collective of the forward (the plan's splits,
switches, head switches and gathers, and the hooks around them) lands in ONE graph; the one graph break
left is the model's own post-hook (``runtime.root_post``: the 1/N on the gradient of the replicated
output), which dynamo compiles as a second frame of one ``autograd_function_apply`` and no collective.
Compiled outputs and gradients (``backend="aot_eager"``, ``dynamic=False`` and ``True``) equal eager's
within fp32 tolerance. No graph holds a host sync: dynamo breaks the graph at ``.item()``/``.tolist()``,
so the one graph with every collective shows none ran inside it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import run_distributed

COLLECTIVE = ("_c10d_functional", "c10d.")


def _model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, object]]:
    g = torch.Generator().manual_seed(1)
    if name == "stdit":
        from dsp_plugin.models.stdit import STDiT, STDiTConfig

        torch.manual_seed(0)
        return (STDiT(STDiTConfig.preset("tiny", axes=2)),
                (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g)),
                {})
    from dsp_plugin.testing.tiny import tiny_latte, tiny_wan

    if name == "latte":
        return (tiny_latte(frames=5, layers=2, heads=3, head_dim=4, sample_size=6),
                (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 7, 16, generator=g)),
                {"return_dict": False})
    return (tiny_wan(layers=2, heads=3, head_dim=8),
            (torch.randn(2, 4, 5, 6, 6, generator=g), torch.tensor([3, 500]), torch.randn(2, 7, 16, generator=g)),
            {"return_dict": False})


def _step(model: torch.nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]
          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = args[0].clone().requires_grad_(True)
    out = model(x, *args[1:], **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def _worker(rank: int, n: int, name: str, dynamic: bool) -> dict[str, object]:
    import torch._dynamo as dynamo

    import dsp_plugin

    base, args, kwargs = _model(name)
    eager_model = dsp_plugin.parallelize(copy.deepcopy(base))
    out, dx, grads = _step(eager_model, args, kwargs)   # eager first: the first call's cross-rank checks
    explained = dynamo.explain(eager_model)(*args, **kwargs)
    graphs = [sorted({str(node.target) for node in g.graph.nodes if any(c in str(node.target) for c in COLLECTIVE)})
              for g in explained.graphs]
    dynamo.reset()
    compiled_model = dsp_plugin.parallelize(copy.deepcopy(base))
    _step(compiled_model, args, kwargs)
    for p in compiled_model.parameters():
        p.grad = None
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=dynamic)
    c_out, c_dx, c_grads = _step(compiled, args, kwargs)
    return {"breaks": explained.graph_break_count, "graphs": len(graphs), "collectives": graphs,
            "reasons": [str(b.reason)[:200] for b in explained.break_reasons],
            "out": (c_out - out).abs().max().item(), "dx": (c_dx - dx).abs().max().item(),
            "grads": max((a - b).abs().max().item() for a, b in zip(c_grads, grads) if a is not None)}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", ["stdit", "wan", "latte"])
def test_compiled_plan_model_equals_eager(name: str, dynamic: bool) -> None:
    for rank, d in enumerate(run_distributed(_worker, 2, name, dynamic, timeout=900)):
        print(f"{name} dynamic={dynamic} rank {rank}: {d}")
        assert d["breaks"] <= 1 and d["graphs"] == d["breaks"] + 1, d
        assert d["collectives"][0] and not any(d["collectives"][1:]), d  # every collective in the first graph
        assert max(d["out"], d["dx"], d["grads"]) < 1e-5, d
