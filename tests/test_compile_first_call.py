"""A fresh parallelized model's first call compiled, with no eager call before it (issue 49's compile findings,
issue 52 silent-6 and unclear-15, -16).

- Inputs that differ per rank are refused at the compiled first call, on every rank, with the eager check's
  error (before: traced, the model's pre-hook skipped the check, and the outputs were silently wrong): the
  check is an op of the compiled graph (``plan/compiled_entry.py``). Both orders: compiled first, and an eager
  first call (refused) followed by a compiled one (refused too: the signature was never agreed).
- ``torch.compile(parallelize(wan), fullgraph=True)`` compiles the tiny diffusers Wan at its first call with 0
  graph breaks (before: ``every_gradient``'s learning forward was traced, and ``is_fake`` broke the graph), and
  that first forward and backward equal one process (fp64): the learning forward's hooks run outside dynamo
  (``every_gradient._Eager``) and learn from the compiled graph's autograd edges.
- A block whose forward was replaced after ``parallelize`` by one without the activation's parameter name gets
  an error saying so, and what to do (before: "'hidden_states' is NoneType; expected a tensor (set Block.arg)").
"""

from __future__ import annotations

import copy
import types

import torch

from tests.distributed import run_distributed


def _wan(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from dsp_plugin.testing.tiny import tiny_wan

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 5, 6, 6, generator=g, dtype=dtype), torch.tensor([3, 500]),
            torch.randn(2, 7, 16, generator=g, dtype=dtype))
    return tiny_wan(layers=1, heads=3, head_dim=8).to(dtype), args


def _refusals(rank: int, n: int, order: str) -> list[str]:
    import torch._dynamo as dynamo

    import dsp_plugin
    from dsp_plugin.checks import InputMismatch

    dynamo.reset()
    base, (x, timestep, text) = _wan()
    model = dsp_plugin.parallelize(copy.deepcopy(base))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    calls = ([model] if order == "eager" else []) + [compiled]
    said = []
    for call in calls:
        try:
            call(x + rank, timestep, text, return_dict=False)   # an unseeded draw: a latent per rank
        except InputMismatch as exc:
            said.append(str(exc))
        else:
            said.append("no error")
    return said


def test_compiled_first_call_refuses_differing_inputs_on_every_rank() -> None:
    messages = {}
    for order in ("compiled", "eager"):
        for rank, said in enumerate(run_distributed(_refusals, 2, order)):
            print(f"{order} first, rank {rank}: {said}")
            messages[order, rank] = said
    expected = messages["eager", 0][0]
    assert expected.startswith("parallelize(WanTransformer3DModel): the inputs differ across the 2 ranks of group "
                               "[0, 1]: hidden_states (alike on ranks [0] | [1])"), expected
    # the same error on every rank, compiled or eager, first or after an eager refusal
    assert all(said == [expected] * len(said) for said in messages.values()), messages
    assert len(messages["eager", 0]) == 2


def _first_call(rank: int, n: int) -> dict[str, object]:
    import torch._dynamo as dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dsp_plugin
    from dsp_plugin.comm import reduce_gradients

    base, (x, timestep, text) = _wan(torch.float64)
    target = torch.randn(2, 4, 5, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        latents = x.clone().requires_grad_(True)
        out = model(latents, timestep, text, return_dict=False)[0]
        torch.nn.functional.mse_loss(out, target).backward()
        return out.detach(), latents.grad

    reference = copy.deepcopy(base)
    out_ref, dx_ref = step(reference)
    dynamo.reset()
    counters.clear()
    model = dsp_plugin.parallelize(copy.deepcopy(base))
    out, dx = step(torch.compile(model, backend="aot_eager", fullgraph=True))   # no eager call before
    reduce_gradients(model.parameters())   # the convention: the group's sum is the one-process gradient
    dist.all_reduce(dx)
    grads = {k: p.grad for k, p in model.named_parameters()}
    expected = dict(reference.named_parameters())
    assert all((grads[k] is None) == (p.grad is None) for k, p in expected.items())
    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "out": (out - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item(),
            "grads": max((grads[k] - p.grad).abs().max().item() for k, p in expected.items() if p.grad is not None)}


def test_fullgraph_compiles_a_fresh_parallelized_wan_at_its_first_call() -> None:
    for rank, d in enumerate(run_distributed(_first_call, 2, timeout=600)):
        print(f"rank {rank}: {d}")
        assert d["breaks"] == 0, d
        # Wan's blocks compute the adaLN modulation in fp32 even in fp64 (tests/test_plan_models.py)
        assert d["out"] < 1e-9 and d["dx"] < 1e-9 and d["grads"] < 5e-9, d


def _attribute_under_ddp(rank: int, n: int) -> dict[str, object]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import dsp_plugin
    from dsp_plugin.topology import set_topology
    from tests.user_paths_models import ATTRIBUTE_PLAN, AttributeAdapter

    torch.set_default_dtype(torch.float64)
    set_topology(None)
    group = dist.new_group([0, 1])
    model = dsp_plugin.parallelize(AttributeAdapter(group, planned=True, unused=False), ATTRIBUTE_PLAN, group=group)
    trained = DistributedDataParallel(torch.compile(model, backend="aot_eager", fullgraph=True), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for x, target in _batches():
        opt.zero_grad()
        (2.0 * torch.nn.functional.mse_loss(trained(x), target)).backward()   # DDP averages; the group sums
        had = {k.removeprefix("net."): p.grad is not None for k, p in model.named_parameters()}
        opt.step()
    return {"had": had, "params": {k.removeprefix("net."): p.detach().clone() for k, p in model.named_parameters()}}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 5, 4, generator=g, dtype=torch.float64),
             torch.randn(2, 5, 4, generator=g, dtype=torch.float64)) for _ in range(2)]


def test_a_compiled_first_call_learns_a_parameter_one_rank_uses() -> None:
    """The learning forward compiled (torch DDP over the compiled model): the rank without ``emb.cls_token`` (read on
    the rank holding frame 0 only, ``tests/user_paths_models.py``) learns it from the compiled graph's autograd
    edges and gives it a zero gradient, so DDP's bucket completes; two SGD steps equal one process."""
    from tests.user_paths_models import Net, sgd_reference

    torch.set_default_dtype(torch.float64)
    try:
        reference = sgd_reference(Net(unused=False), _batches(), 0.3)
    finally:
        torch.set_default_dtype(torch.float32)
    for rank, d in enumerate(run_distributed(_attribute_under_ddp, 2, timeout=300, collective_timeout_s=30)):
        print(f"rank {rank}: had {d['had']}")
        assert d["had"]["emb.cls_token"], d["had"]
        for name, p in reference.items():
            assert (d["params"][name] - p).abs().max() < 1e-12, (rank, name)


def test_a_forward_replaced_after_parallelize_is_named_in_the_error() -> None:
    import dsp_plugin

    base, (x, timestep, text) = _wan()
    model = dsp_plugin.parallelize(copy.deepcopy(base))
    block = model.blocks[0]
    own = type(block).forward

    def my_forward(self: torch.nn.Module, x: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                   rotary_emb: torch.Tensor) -> torch.Tensor:
        return own(self, x, encoder_hidden_states, temb, rotary_emb)

    block.forward = types.MethodType(my_forward, block)
    try:
        model(x, timestep, text, return_dict=False)
    except ValueError as exc:
        said = str(exc)
    else:
        said = "no error"
    print(said)
    assert said.startswith("blocks.0: the block's activation 'hidden_states' is NoneType; expected a tensor. blocks.0's "
                           "forward was replaced after parallelize by "), said
    assert "my_forward(x, encoder_hidden_states, temb, rotary_emb)" in said and "which it does not have" in said, said
    assert "Keep the forward's parameter names in the replacement, set Block.arg" in said, said
    assert "under torch.compile a forward replaced after parallelize is not wrapped again" in said, said
