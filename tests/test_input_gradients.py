"""The input-gradient conventions (issue 25, item 12), each pinned on two ranks against one process (fp64).

- The primitives: ``split``'s backward gathers, so an input given to ``split`` has the *full*
  gradient on every rank.
- ``parallelize``: a replicated input's gradient is *partial* over the DSP group (each rank its own
  tokens' contribution, no collective); the sum over the group is the one-process gradient, and no
  rank holds it alone.
- ``replicate_grad(x)``: the full gradient on every rank, differentiable twice: a gradient penalty
  on the input trains like one process.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed import run_distributed


def _stdit() -> torch.nn.Module:
    from dsp_plugin.models.stdit import STDiT, STDiTConfig

    torch.manual_seed(0)
    return STDiT(STDiTConfig.preset("tiny")).double()


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return (torch.randn(2, 4, 5, 4, 4, generator=g, dtype=torch.float64), torch.tensor([3, 500]),
            torch.randn(2, 3, 16, generator=g, dtype=torch.float64))


def _math_attention() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _one_process() -> dict[str, Any]:
    latents, timestep, text = _batch()
    model = _stdit()
    x = latents.clone().requires_grad_(True)
    model(x, timestep, text).square().mean().backward()
    # a gradient penalty on the input: || d loss / d x ||^2, trained through its own backward
    model.zero_grad()
    x2 = latents.clone().requires_grad_(True)
    with _math_attention():   # CPU flash attention has no double backward
        (g,) = torch.autograd.grad(model(x2, timestep, text).square().mean(), x2, create_graph=True)
        g.square().sum().backward()
    return {"dx": x.grad, "penalty_dx": g.detach(), "penalty_grads": {k: p.grad.clone()
                                                                      for k, p in model.named_parameters()}}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    import dsp_plugin
    from dsp_plugin import gather, replicate_grad, split

    reference = _one_process()
    latents, timestep, text = _batch()
    out: dict[str, Any] = {}
    # the primitives: split's backward gathers, so x.grad is the full one here
    x = latents.clone().requires_grad_(True)
    w = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    gather(split(x, 2) * split(w, 0), 2).square().mean().backward()
    x_ref = latents.clone().requires_grad_(True)
    (x_ref * w).square().mean().backward()
    out["split_dx"] = (x.grad - x_ref.grad).abs().max().item()
    # parallelize: partial on each rank, the sum is the one-process gradient
    model = dsp_plugin.parallelize(_stdit())
    x = latents.clone().requires_grad_(True)
    model(x, timestep, text).square().mean().backward()
    out["partial_alone"] = (x.grad - reference["dx"]).abs().max().item()
    total = x.grad.clone()
    dist.all_reduce(total)
    out["partial_sum"] = (total - reference["dx"]).abs().max().item()
    # replicate_grad: the full gradient on every rank, and a gradient penalty through it
    model = dsp_plugin.parallelize(_stdit())
    x = latents.clone().requires_grad_(True)
    with _math_attention():
        (g,) = torch.autograd.grad(model(replicate_grad(x), timestep, text).square().mean(), x, create_graph=True)
        out["replicated_dx"] = (g - reference["penalty_dx"]).abs().max().item()
        g.square().sum().backward()
    dsp_plugin.reduce_gradients(model.named_parameters())
    out["penalty_grads"] = max((p.grad - reference["penalty_grads"][k]).abs().max().item()
                               for k, p in model.named_parameters())
    return out


def test_input_gradient_conventions() -> None:
    for rank, d in enumerate(run_distributed(_worker, 2)):
        print(f"rank {rank}: {d}")
        assert d["split_dx"] < 1e-12, d                  # primitives: full on every rank
        assert d["partial_sum"] < 1e-12, d               # parallelize: the sum over the group is the full one
        assert d["partial_alone"] > 1e-3, d              # ... and no rank holds it alone
        assert d["replicated_dx"] < 1e-12, d             # replicate_grad: full on every rank
        assert d["penalty_grads"] < 1e-12, d             # and differentiable twice


def test_replicate_grad_on_one_process_is_the_identity() -> None:
    from dsp_plugin import replicate_grad

    x = torch.randn(3, 2, requires_grad=True)
    assert replicate_grad(x) is x
    try:
        replicate_grad([1.0])  # type: ignore[arg-type]
    except TypeError as exc:
        assert "expected a torch.Tensor, got list" in str(exc)
    else:
        raise AssertionError("replicate_grad accepted a list")
