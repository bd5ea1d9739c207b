"""Each baseline equals the single-process model (outputs, input and parameter gradients).

One spawned run per world size checks every method and case, so the suite pays
for process start-up twice. Workers return the max absolute errors and the
collective counts; the assertions run in the parent.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed

TOL = 1e-5
DEPTH = 2


def _config(heads: int) -> Any:
    from dsp_plugin.models import STDiTConfig

    return STDiTConfig.preset("tiny", depth=DEPTH, num_heads=heads, hidden_size=8 * heads)


def _inputs(frames: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, frames, 4, 4, generator=g)
    return latents, torch.tensor([3.0, 17.0]), torch.randn(2, 3, 16, generator=g)


def _compare(method: str, heads: int, frames: int) -> dict[str, Any]:
    """Run ``method`` and the single-process model on the same input; return errors and counts."""
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.baselines import PARALLELIZE
    from dsp_plugin.baselines.megatron_sp import reduce_replicated_gradients
    from dsp_plugin.comm import reduce_gradients
    from dsp_plugin.models import STDiT

    torch.manual_seed(0)
    reference = STDiT(_config(heads))
    model = PARALLELIZE[method](copy.deepcopy(reference))
    latents, timestep, text = _inputs(frames)
    weight = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))

    ref_in = latents.clone().requires_grad_()
    (reference(ref_in, timestep, text) * weight).sum().backward()
    par_in = latents.clone().requires_grad_()
    with CommAccounting(activations=False) as acct:
        out = model(par_in, timestep, text)
        (out * weight).sum().backward()
    if method == "megatron_sp":
        reduce_replicated_gradients(model)
    else:
        reduce_gradients(model.parameters())

    ref_out = reference(latents, timestep, text)
    errors = {"output": (out - ref_out).abs().max().item(),
              "input_grad": (par_in.grad - ref_in.grad).abs().max().item()}
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        full = ref_params[name].grad
        expected = param.tp_slice(full) if getattr(param, "tensor_model_parallel", False) else full
        worst = max(worst, (param.grad - expected).abs().max().item())
    errors["param_grad"] = worst
    return {"errors": errors, "counts": acct.summary()}


def _expect_error(method: str, heads: int, frames: int) -> str:
    try:
        _compare(method, heads, frames)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _worker(rank: int, world_size: int, cases: list[tuple[str, int, int]],
            bad: list[tuple[str, int, int]]) -> dict[str, Any]:
    results = {f"{m}/h{h}/T{t}": _compare(m, h, t) for m, h, t in cases}
    results.update({f"error:{m}/h{h}/T{t}": _expect_error(m, h, t) for m, h, t in bad})
    return results


def _forward_count(counts: dict[str, dict[str, int]], op: str) -> int:
    return counts.get(f"{op}/forward", {}).get("count", 0)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_baselines_match_single_process(world_size: int) -> None:
    heads = world_size  # Ulysses and Megatron-SP need N | heads
    even, uneven = 2 * world_size, 2 * world_size + 1
    cases = [("ulysses", heads, even), ("ulysses_paper", heads, even), ("megatron_sp", heads, even),
             ("ring", heads, even), ("ring", 2, uneven)]
    fewer = world_size // 2                                                  # N larger than the heads
    bad = [("ulysses", fewer, even), ("ulysses_paper", fewer, even), ("megatron_sp", fewer, even),
           ("ulysses", heads, uneven), ("ulysses_paper", heads, uneven), ("megatron_sp", heads, uneven)]
    if world_size == 4:
        bad += [("ulysses", 6, even), ("ulysses_paper", 6, even), ("megatron_sp", 6, even)]  # N does not divide
    try:
        import deepspeed  # noqa: F401  (Ulysses is DeepSpeed's own code)
    except ImportError:
        cases = [c for c in cases if c[0] != "ulysses"]
        bad = [b for b in bad if b[0] != "ulysses"]
    per_rank = run_distributed(_worker, world_size, cases, bad, timeout=200)

    for rank, results in enumerate(per_rank):
        for key, value in results.items():
            if key.startswith("error:"):
                assert value != "no error", f"rank {rank}: {key} should have raised"
                assert "N=" in value or "ranks" in value, value
                continue
            for what, err in value["errors"].items():
                assert err < TOL, f"rank {rank} {key}: {what} differs by {err}"
        n = world_size
        counts = {k: v["counts"] for k, v in results.items() if not k.startswith("error:")}
        # one exit all_gather for every method; the rest is the method's own traffic
        if f"ulysses/h{heads}/T{even}" in counts:
            assert _forward_count(counts[f"ulysses/h{heads}/T{even}"], "all_to_all") == 4 * DEPTH
        # the paper's harness: q, k, v, o around the self-attention AND the cross-attention of both blocks
        paper = counts[f"ulysses_paper/h{heads}/T{even}"]
        assert _forward_count(paper, "all_to_all") == 2 * (4 + 4) * DEPTH
        assert paper["all_to_all/backward"]["count"] == 2 * (4 + 4) * DEPTH
        mega = counts[f"megatron_sp/h{heads}/T{even}"]
        assert _forward_count(mega, "reduce_scatter") == 2 * 2 * DEPTH
        assert _forward_count(mega, "all_gather") == 2 * 2 * DEPTH + 1
        assert _forward_count(counts[f"ring/h{heads}/T{even}"], "send") == 2 * (n - 1) * DEPTH


def test_head_limit_messages_name_the_numbers() -> None:
    from dsp_plugin.baselines.common import check_heads

    with pytest.raises(ValueError, match=r"16 attention heads cannot be sharded over 32 ranks"):
        check_heads("ulysses", 16, 32)
    check_heads("megatron_sp", 16, 16)
