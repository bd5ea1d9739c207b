"""docs/models.md's two plans for your own model, run as printed on 2 and 4 ranks.

Each doc block asserts, in every worker, that the parallelized model's output
equals the unmodified model's on one process. Here, in addition: gradients
summed over the group equal the one-process gradients; the classifier whose CLS
token is owned by rank 0 trains 3 SGD steps equal to one process, with nothing
in the training loop but ``reduce_gradients``; the forward's collectives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsp_plugin import reduce_gradients
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.testing.examples import DividedSpaceTime, VideoViT
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _plan_blocks() -> list[str]:
    text = (ROOT / "docs/models.md").read_text()
    section = text[text.index("## A plan for your own model"):text.index("**Hooks or an adapter forward?**")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_doc_plans_are_short() -> None:
    blocks = _plan_blocks()
    assert len(blocks) == 2
    for code in blocks:
        plan = re.search(r"_PLAN = \{\n(.*?)\n\}", code, flags=re.S)
        assert plan is not None and len(plan.group(1).splitlines()) + 2 <= 20, code


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, n: int) -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    result: dict[str, float] = {}
    models = {}
    for i, code in enumerate(_plan_blocks()):
        scope: dict = {"__name__": "__docs__"}
        exec(compile(code, "docs/models.md", "exec"), scope)  # noqa: S102 - our own docs; asserts the output
        model = models[i] = scope["model"]
        reference = DividedSpaceTime() if i == 0 else VideoViT()
        g = torch.Generator().manual_seed(1)
        video = torch.randn(2, 5, 9, 4, generator=g)
        args = (video, torch.randn(2, 5, 16, generator=g)) if i == 0 else (video,)
        labels = torch.tensor([1, 3])
        loss = (lambda out: out.square().mean()) if i == 0 else (
            lambda out: torch.nn.functional.cross_entropy(out, labels))
        with CommAccounting(activations=False) as acct:
            out = model(*args)
        loss(out).backward()
        loss(reference(*args)).backward()
        reduce_gradients(model.parameters())
        g_ref, g_par = _grads(reference), _grads(model)
        assert g_ref.keys() == g_par.keys()
        result[f"{i}_grads"] = max((g_par[k] - g_ref[k]).abs().max().item() for k in g_ref)
        result[f"{i}_all_to_all"] = acct.count("all_to_all", "forward")
        result[f"{i}_all_gather"] = acct.count("all_gather", "forward")
    # the classifier trains: 3 SGD steps, the CLS token owned by rank 0, nothing special in the loop
    model, reference = scope["model"], VideoViT()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        video, labels = torch.randn(2, 5, 9, 4, generator=g), torch.randint(0, 5, (2,), generator=g)
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(video), labels).backward()
            if m is model:
                reduce_gradients(m.parameters())
            o.step()
    result["trained"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    # too few frames for the group: the same clear error on every rank, before any collective
    try:
        models[0](torch.randn(2, 1, 9, 4), torch.randn(2, 1, 16))
    except ValueError as exc:
        result["too_short"] = str(exc)
    dist.barrier()
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_doc_plans_on_ranks(n: int) -> None:
    for rank, d in enumerate(run_distributed(_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        d = dict(d)
        assert "cannot be split over" in d["too_short"] and f"length >= {n}" in d["too_short"], d
        for key in ("0_grads", "1_grads", "trained"):
            assert d[key] < 1e-12, (rank, key, d)
        assert d["0_all_to_all"] == 4 and d["1_all_to_all"] == 4, d   # 2 layers x (one switch there, one back)
        assert d["0_all_gather"] == 1 and d["1_all_gather"] == 1, d
