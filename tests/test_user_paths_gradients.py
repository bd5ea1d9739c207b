"""A parameter used outside its module's forward, on some ranks only, trains like one process (issue 25, item 6).

``AttributeAdapter`` (``tests.user_paths_models``) reads ``emb.cls_token`` as an attribute on the
rank that holds frame 0; ``emb``'s forward never runs, so a hook on ``emb`` cannot give the other
rank its zero gradient. On two ranks, two SGD steps, against ``Net`` on one process (fp64):

- torch DDP over ``parallelize(adapter, ATTRIBUTE_PLAN)``: DDP needs a gradient for every
  parameter on every rank (before: the rank with the token waited in its bucket's all_reduce
  until the timeout);
- ``reduce_gradients`` over the same and over the hand-written adapter (it always coped).

A parameter no rank uses keeps no gradient, as on one process. ZeRO-2/-3 run the same adapter in
``tests/test_user_paths_deepspeed.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed import run_distributed
from tests.user_paths_models import ATTRIBUTE_PLAN, AttributeAdapter, Net, sgd_reference

LR, STEPS = 0.3, 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 5, 4, generator=g, dtype=torch.float64),
             torch.randn(2, 5, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import dsp_plugin
    from dsp_plugin.topology import set_topology

    torch.set_default_dtype(torch.float64)
    set_topology(None)
    group = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    for variant in ("ddp_parallelize", "reduce_parallelize", "reduce_hand_written"):
        planned = variant != "reduce_hand_written"
        model = AttributeAdapter(group, planned=planned, unused=variant != "ddp_parallelize")
        if planned:
            model = dsp_plugin.parallelize(model, ATTRIBUTE_PLAN, group=group)
        if variant == "ddp_parallelize":   # DDP averages over its 2 ranks; the convention sums over DSP: loss x 2
            trained, scale = DistributedDataParallel(model, process_group=group), 2.0
        else:
            trained, scale = model, 1.0
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        had = {}
        for x, target in _batches():
            opt.zero_grad()
            (scale * torch.nn.functional.mse_loss(trained(x), target)).backward()
            had = {k.removeprefix("net."): p.grad is not None for k, p in model.named_parameters()}
            if variant.startswith("reduce"):
                dsp_plugin.reduce_gradients(model.named_parameters(), topology=_pair_topology(group))
            opt.step()
        out[variant] = {"params": {k.removeprefix("net."): p.detach().numpy().copy()
                                   for k, p in model.named_parameters()}, "had": had}
    return out


def _pair_topology(group: Any) -> Any:
    """The explicit pair as a topology for ``reduce_gradients`` (DSP 2, DP 1)."""
    import torch.distributed as dist

    from dsp_plugin.topology import Topology

    return Topology(tp=1, dsp=2, dp=1, pp=1, rank=dist.get_rank(), world_size=2, dsp_group=group, dp_dsp_group=group)


def test_attribute_parameter_on_one_rank_trains_like_one_process_under_ddp_and_reduce_gradients() -> None:
    torch.set_default_dtype(torch.float64)
    try:   # torch DDP itself refuses a parameter no rank uses: its model has none
        references = {unused: sgd_reference(Net(unused=unused), _batches(), LR) for unused in (True, False)}
    finally:
        torch.set_default_dtype(torch.float32)
    results = run_distributed(_worker, 2, timeout=240, collective_timeout_s=30)
    assert results[0]["reduce_hand_written"]["had"]["emb.cls_token"] is True
    for rank, by_variant in enumerate(results):
        for variant, d in by_variant.items():
            print(f"rank {rank} {variant}: had {d['had']}")
            reference = references[variant != "ddp_parallelize"]
            assert d["params"].keys() == reference.keys()
            for name, p in reference.items():
                diff = float(abs(d["params"][name] - p.numpy()).max())
                assert diff < 1e-12, f"rank {rank} {variant}: {name} differs from one process by {diff:.3g}"
            assert not d["had"].get("unused"), f"rank {rank} {variant}: a parameter no rank uses got a gradient"
            if variant != "reduce_hand_written":   # parallelize gives the rank without the token its zero
                assert d["had"]["emb.cls_token"], f"rank {rank} {variant}: no gradient for emb.cls_token"
