"""The reference STDiT through ``dsp_plugin.parallelize`` (the plan runtime) equals one process.

The switches are the Belady schedule's (``switch_schedule``, compiled once), one all-to-all each;
5 frames on 2 ranks (uneven), 2 and 3 axes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _worker(rank: int, n: int, axes: int) -> dict[str, float]:
    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.models.stdit import STDiT, STDiTConfig
    from dsp_plugin.plan.schedule import switch_schedule

    torch.manual_seed(0)
    reference = STDiT(STDiTConfig.preset("tiny", axes=axes)).double()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 5, 6, 6, generator=g, dtype=torch.float64)
    timestep, text = torch.tensor([3, 500]), torch.randn(2, 3, 16, generator=g, dtype=torch.float64)

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, CommAccounting]:
        x = latents.clone().requires_grad_(True)
        with CommAccounting(activations=False) as acct:
            out = model(x, timestep, text)
        out.square().mean().backward()
        return out.detach(), x.grad, acct

    out_ref, dx_ref, _ = run(reference)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    out, dx, acct = run(model)
    reduce_gradients(model.parameters())
    dist.all_reduce(dx)
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    schedule, _ = switch_schedule([b.attend_dim for b in reference.blocks], reference.sequence_dims, first_shard=1)
    return {"out": (out - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item(), "grads": grads,
            "all_to_all": acct.count("all_to_all", "forward"), "scheduled": sum(s is not None for s in schedule)}


@pytest.mark.parametrize("axes", [2, 3])
def test_stdit_through_the_plan_runtime(axes: int) -> None:
    for rank, d in enumerate(run_distributed(_worker, 2, axes)):
        print(f"axes={axes} rank {rank}: {d}")
        assert max(d["out"], d["dx"], d["grads"]) < 1e-12, d
        assert d["all_to_all"] == d["scheduled"] > 0, d


def test_the_old_hook_runtime_is_gone_and_names_its_replacement() -> None:
    import dsp_plugin.models

    for name in ("parallelize", "DSPPlan"):
        with pytest.raises(AttributeError, match=r"use dsp_plugin\.parallelize\(model\)"):
            getattr(dsp_plugin.models, name)
