"""``gather(partial_grad=True)``: backward is the reduce-scatter (the sum of the ranks' gradients, this rank's
chunk), uneven lengths included, differentiable twice; and the plan's ``Gather(partial_grad=True)``.

Gradients are checked against what they must be: the sum over the ranks of gradients each rank draws from
its own seed (integer-valued float64, so sums are exact and ``torch.equal`` applies), and a double backward
against one process. ``torch.autograd.gradcheck`` does not apply across ranks: it perturbs one element at a
time on every rank at once, and each rank's output depends on every rank's input, so the exactness of the
adjoint is checked directly instead (``<gather(x), g>`` summed over ranks equals ``<x, backward(g)>``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsp_plugin import gather
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.checks import CrossRankMismatch
from tests.distributed import run_distributed

# (shape, sharded dim): uneven (13 and 6 over 2 and 4 ranks, 5 over 4) and even
CASES = [((2, 13, 3), 1), ((6, 4), 0), ((1, 3, 5, 2), 2), ((2, 8, 3), 1)]


def _ints(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).double()


def _backward_is_the_sum(rank: int, n: int) -> list[dict[str, object]]:
    out = []
    for case, (shape, dim) in enumerate(CASES):
        full = _ints(shape, case)
        grads = [_ints(shape, 1000 * case + r) for r in range(n)]   # every rank's own gradient, seen by all
        shard = full.tensor_split(n, dim)[rank].clone().requires_grad_(True)
        with CommAccounting() as acct:
            y = gather(shard, dim, partial_grad=True, global_len=shape[dim])
            y.backward(grads[rank])
        expected = sum(grads).tensor_split(n, dim)[rank]
        # the adjoint, exactly: <gather(x), g> summed over ranks == <x, backward(g)> summed over ranks
        pairing = torch.tensor([float((y.detach() * grads[rank]).sum()), float((shard.detach() * shard.grad).sum())],
                               dtype=torch.float64)
        dist.all_reduce(pairing)
        out.append({"forward": torch.equal(y, full), "backward": torch.equal(shard.grad, expected),
                    "adjoint": pairing[0].item() == pairing[1].item(),
                    "ops": [(r.op, r.phase) for r in acct.records]})
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_backward_is_the_sum_of_the_ranks_gradients(world_size: int) -> None:
    for res in run_distributed(_backward_is_the_sum, world_size):
        for case, r in zip(CASES, res):
            assert r["backward"], (f"{case}: gather(partial_grad=True)'s backward is not the sum over the ranks of "
                                   f"their gradients, this rank's chunk: {r}")
            assert r["forward"] and r["adjoint"], (case, r)
            assert r["ops"] == [("all_gather", "forward"), ("reduce_scatter", "backward")], (case, r["ops"])


def _penalty(q: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(q @ y.transpose(0, 1)).square().sum()


def _double_backward(rank: int, n: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q_full = torch.randn(13, 3, generator=g, dtype=torch.float64)    # the work each rank does on its own rows
    y_full = torch.randn(13, 3, generator=g, dtype=torch.float64)    # the gathered operand (uneven: 13 rows)
    q = q_full.tensor_split(n)[rank].clone().requires_grad_(True)
    y = y_full.tensor_split(n)[rank].clone().requires_grad_(True)
    (dy,) = torch.autograd.grad(_penalty(q, gather(y, 0, partial_grad=True, global_len=13)), y, create_graph=True)
    dy.square().sum().backward()                     # second order: through the reduce-scatter's backward too
    q_ref, y_ref = q_full.clone().requires_grad_(True), y_full.clone().requires_grad_(True)
    (dy_ref,) = torch.autograd.grad(_penalty(q_ref, y_ref), y_ref, create_graph=True)
    dy_ref.square().sum().backward()
    return {"dy": (dy.detach() - dy_ref.detach().tensor_split(n)[rank]).abs().max().item(),
            "dq": (q.grad - q_ref.grad.tensor_split(n)[rank]).abs().max().item(),
            "d2y": (y.grad - y_ref.grad.tensor_split(n)[rank]).abs().max().item(),
            "norm": min(q_ref.grad.norm().item(), y_ref.grad.norm().item())}


@pytest.mark.parametrize("world_size", [2, 4])
def test_double_backward_matches_one_process(world_size: int) -> None:
    for d in run_distributed(_double_backward, world_size):
        assert d["norm"] > 0.1
        for key in ("dy", "dq", "d2y"):
            assert d[key] < 1e-12, (key, d)


def _refusals(rank: int, n: int) -> dict[str, str]:
    x = torch.randn(2, 3)
    out = {}
    for name, kwargs in (("type", {"partial_grad": "yes" if rank == 1 else True}),
                         ("disagree", {"partial_grad": rank == 0})):
        try:
            gather(x, 1, global_len=3 * n, **kwargs)
            out[name] = "no error"
        except (TypeError, CrossRankMismatch) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    own = [dist.new_group([r]) for r in range(n)][rank]
    with CommAccounting() as acct:
        out["identity"] = str(gather(x, 1, group=own, partial_grad=True) is x and not acct.records)
    return out


def test_bad_partial_grad_is_refused_on_every_rank() -> None:
    for rank, res in enumerate(run_distributed(_refusals, 2)):
        assert "partial_grad must be a bool" in res["type"] and "'yes'" in res["type"], (rank, res)
        assert res["type"].startswith("CrossRankMismatch: gather: rank(s) [1] "), (rank, res)  # rank 1's own error
        assert "CrossRankMismatch" in res["disagree"] and "partial_grad" in res["disagree"], (rank, res)
        assert res["identity"] == "True"


class _Memory(torch.nn.Module):
    """Each row of ``x`` attends to every row of ``memory``: the memory feeds work each rank does on its rows."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return (self.q(x) @ self.k(memory).transpose(1, 2)).softmax(-1) @ self.v(memory)


class _Toy(torch.nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.embed, self.memory, self.head = torch.nn.Linear(d, d), _Memory(d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.memory(h, h)          # a residual in the parent: the activation stays sharded on T
        return self.head(h)


def _plan_gather(rank: int, n: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.plan import Gather, Split

    x = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)   # T=7: uneven
    torch.manual_seed(0)
    reference = _Toy().double()
    x_ref = x.clone().requires_grad_(True)
    reference(x_ref).square().sum().backward()
    torch.manual_seed(0)
    model = dsp_plugin.parallelize(_Toy().double(), {
        "embed": Split(0, "B T D", "T"),
        "memory": Gather("memory", "B T D", partial_grad=True),   # the rows (``x``) stay sharded
        "head": Gather(0, "B T D")})
    x_in = x.clone().requires_grad_(True)
    with CommAccounting() as acct:
        y = model(x_in)
        y.square().sum().backward()
    reduce_gradients(model.named_parameters())
    dist.all_reduce(x_in.grad)             # parallelize: a replicated input's gradient is partial over the group
    return {"output": (y - reference(x)).abs().max().item(),
            "grads": {name: (p.grad - q.grad).abs().max().item() for (name, p), q in
                      zip(model.named_parameters(), reference.parameters())},
            "input": (x_in.grad - x_ref.grad).abs().max().item(),
            "backward": sorted({r.op for r in acct.records if r.phase == "backward"})}


@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_gather_partial_grad_matches_one_process(world_size: int) -> None:
    for rank, res in enumerate(run_distributed(_plan_gather, world_size)):
        assert max(res["grads"].values()) < 1e-12, (f"rank {rank}: Gather(partial_grad=True): parameter gradients "
                                                    f"after reduce_gradients differ from one process: {res['grads']}")
        assert res["output"] < 1e-12 and res["input"] < 1e-12, (rank, res)
        assert res["backward"] == ["reduce_scatter"], res["backward"]  # the partial gather's; no all_reduce
