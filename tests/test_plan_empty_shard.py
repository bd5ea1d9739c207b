"""A rank whose shard is empty never hands an attention kernel an empty batch.

On an NVIDIA H200 with torch 2.11 (``scripts/gpu_check/attention.py``, docs/benchmarks.md "On one
GPU"), cuDNN's SDPA and SDPA's default choice return None for a batch of 0, and flash attention dies
with SIGFPE on no heads. A switch to an axis shorter than the group leaves a rank an empty shard:
the STDiT with three axes (H, W, T) on a 1 x 1 patch grid switches its temporal block to H or W, so
rank 1 attends over no rows. Here SDPA is replaced by a kernel that does what the H200's did (None on
no queries); the model on 2 ranks must still equal one process, outputs and gradients.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from tests.distributed import run_distributed


def _like_the_h200() -> None:
    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if has_torch_function((query, key, value)):
            return handle_torch_function(sdpa, (query, key, value), query, key, value, *args, **kwargs)
        if query.numel() == 0:
            return None                       # cuDNN / the default choice on an empty batch, seen on an H200
        return real(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa


def _worker(rank: int, n: int) -> dict[str, float]:
    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.models.stdit import STDiT, STDiTConfig

    _like_the_h200()
    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny", axes=3)).double()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 5, 2, 2, generator=g, dtype=torch.float64)   # 5 frames of one 2 x 2 patch
    timestep, text = torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g, dtype=torch.float64)

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x = latents.clone().requires_grad_(True)
        out = model(x, timestep, text)
        out.square().mean().backward()
        return out.detach(), x.grad

    out_ref, dx_ref = run(reference)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    out, dx = run(model)
    reduce_gradients(model.parameters())
    dist.all_reduce(dx)
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return {"out": (out - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item(), "grads": grads}


def test_an_empty_shard_calls_no_kernel_and_equals_one_process() -> None:
    for rank, d in enumerate(run_distributed(_worker, 2)):
        print(f"rank {rank}: {d}")
        assert max(d["out"], d["dx"], d["grads"]) < 1e-12, d
