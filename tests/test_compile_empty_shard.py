"""torch.compile of a parallelized model where a rank's shard is empty (issue 28 item 1).

The STDiT with three axes (H, W, T) on a 1 x 1 patch grid switches its temporal block to H or W, of
length 1, so on 2 ranks rank 1 holds no rows there (``tests/test_plan_empty_shard.py`` for eager). Traced,
its switch's send buffer was a ``cat`` of flat blocks, all of shape (0,) on rank 1: ``cat``'s legacy
empty inputs get a fresh ``zeros(0)`` as gradient, so the reverse all-to-all fed no gradient,
AOTAutograd's partitioner left it out of rank 1's backward graph, and gloo failed ("Received data size
doesn't match expected size") when rank 0 made it. Compiled (``aot_eager``, ``dynamic=False``) outputs and
gradients must equal the eager parallel model's on both ranks.
"""

from __future__ import annotations

import copy

import torch

from tests.distributed import run_distributed


def _worker(rank: int, n: int) -> dict[str, float]:
    import dsp_plugin
    from dsp_plugin.models.stdit import STDiT, STDiTConfig

    torch.manual_seed(0)
    base = STDiT(STDiTConfig.preset("tiny", axes=3))
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 5, 2, 2, generator=g)   # 5 frames of one 2 x 2 patch: H = W = 1 after patching
    timestep, text = torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        x = latents.clone().requires_grad_(True)
        out = model(x, timestep, text)
        out.square().mean().backward()
        return out.detach(), x.grad, [p.grad for p in model.parameters()]

    out, dx, grads = step(dsp_plugin.parallelize(copy.deepcopy(base)))
    model = dsp_plugin.parallelize(copy.deepcopy(base))
    step(model)   # the first call's cross-rank checks, eagerly
    c_out, c_dx, c_grads = step(torch.compile(model, backend="aot_eager", dynamic=False))
    return {"out": (c_out - out).abs().max().item(), "dx": (c_dx - dx).abs().max().item(),
            "grads": max((a - b).abs().max().item() for a, b in zip(c_grads, grads) if a is not None)}


def test_compiled_model_with_an_empty_shard_equals_eager() -> None:
    for rank, d in enumerate(run_distributed(_worker, 2, timeout=900)):
        print(f"rank {rank}: max |compiled - eager| {d}")
        assert max(d["out"], d["dx"], d["grads"]) < 1e-5, d
