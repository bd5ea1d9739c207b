"""Under the model's own activation checkpointing, the recompute issues no switch and no head switch.

``dsp_plugin.plan.recompute``: a checkpointed block's recompute takes the forward's
collective outputs. Oracle: the unmodified diffusers model on one process in fp64
(``tests/test_plan_models``' models, batch and tolerances). Counted with
``CommAccounting``: backward all-to-alls with checkpointing equal those without.
Also exact: reentrant checkpointing (nothing kept, collectives run), a forward
without backward before a step, two forwards whose backwards run oldest first
(the older recompute must not take the newer forward's outputs), and nothing kept
after a step.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

pytest.importorskip("diffusers")

import dsp_plugin  # noqa: E402
from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin import dynamic_switch, gather, split  # noqa: E402
from dsp_plugin.plan import Block, Gather, Grid, Heads, Split, recompute  # noqa: E402
from dsp_plugin.testing.examples import DividedSpaceTime, VideoViT  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.test_plan_models import TOLERANCE, _batch, _build, _run  # noqa: E402


def _other(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    latents, timestep, text, target = batch
    return latents.flip(2), timestep.flip(0), text.flip(1), target.flip(3)


class _Step:
    """One parallel forward on ``batch`` (kept for a later ``backward``), counted."""

    def __init__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
        latents, timestep, text, target = batch
        self.model, self.latents = model, latents.clone().requires_grad_(True)
        with CommAccounting(activations=False) as self.forward_acct:
            out = model(self.latents, timestep, text, return_dict=False)[0]
        self.out, self.loss = out.detach(), torch.nn.functional.mse_loss(out, target)
        self.kept_after_forward = recompute.kept()

    def backward(self) -> dict[str, Any]:
        """Backward; errors against the reference are filled in by :func:`_compare`."""
        self.model.zero_grad(set_to_none=True)
        with CommAccounting(activations=False) as acct:
            self.loss.backward()
        reduce_gradients(self.model.parameters())           # the project's convention: sum over the group
        dx = self.latents.grad.clone()
        dist.all_reduce(dx)
        grads = {k: p.grad.clone() for k, p in self.model.named_parameters() if p.grad is not None}
        return {"out": self.out, "dx": dx, "grads": grads, "bwd_a2a": acct.count("all_to_all", "backward"),
                "fwd_a2a": self.forward_acct.count("all_to_all", "forward"), "kept": recompute.kept(),
                "kept_after_forward": self.kept_after_forward}


def _compare(got: dict[str, Any], ref: tuple[Any, ...]) -> dict[str, float]:
    out_ref, dx_ref, g_ref, _ = ref
    assert got["grads"].keys() == g_ref.keys(), sorted(set(got["grads"]) ^ set(g_ref))
    return {"out": (got["out"] - out_ref).abs().max().item(), "dx": (got["dx"] - dx_ref).abs().max().item(),
            "grads": max((got["grads"][k] - g_ref[k]).abs().max().item() for k in g_ref),
            "bwd_a2a": got["bwd_a2a"], "fwd_a2a": got["fwd_a2a"], "kept": got["kept"],
            "kept_after_forward": got["kept_after_forward"]}


def _wan(rank: int, n: int) -> dict[str, dict[str, float]]:
    reference, batch = _build("wan"), _batch("wan")
    ref, ref2 = _run(reference, batch), _run(copy.deepcopy(reference), _other(batch))
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    rows = {"plain": _compare(_Step(model, batch).backward(), ref)}
    model.enable_gradient_checkpointing()
    rows["checkpointed"] = _compare(_Step(model, batch).backward(), ref)
    # a forward with grad and no backward (an evaluation with grad left on), then a step
    _Step(model, _other(batch))
    rows["after_dropped_forward"] = _compare(_Step(model, batch).backward(), ref)
    # two forwards in flight, the older one's backward first: it must not take the newer one's outputs
    first, second = _Step(model, batch), _Step(model, _other(batch))
    rows["older_first"] = _compare(first.backward(), ref)
    rows["newer_second"] = _compare(second.backward(), ref2)
    # a reentrant checkpoint detaches the block's inputs: the split at blocks.0 finds its grid on the detached
    # copy through the carrier's alias notes; its forward runs without grad, so the recompute runs the switches
    model.enable_gradient_checkpointing(lambda block, *args: checkpoint(block.__call__, *args, use_reentrant=True))
    rows["reentrant"] = _compare(_Step(model, batch).backward(), ref)
    return rows


def _latte(rank: int, n: int) -> dict[str, dict[str, float]]:
    reference, batch = _build("latte"), _batch("latte")
    ref = _run(reference, batch)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    rows = {"plain": _compare(_Step(model, batch).backward(), ref)}
    model.enable_gradient_checkpointing()
    for name, stop in (("checkpointed", contextlib.nullcontext()), ("no_early_stop", set_checkpoint_early_stop(False))):
        with stop:  # without early stop the recompute reaches the switch after each block
            rows[name] = _compare(_Step(model, batch).backward(), ref)
    return rows


def _check(name: str, n: int, results: list[dict[str, dict[str, float]]], fresh: tuple[str, ...]) -> None:
    for rank, rows in enumerate(results):
        for row, d in rows.items():
            print(f"{name} n={n} rank {rank} {row}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
            for key in ("out", "dx", "grads"):
                assert d[key] < TOLERANCE[name][key], f"{name} rank {rank}/{n} {row}: {key} {d[key]:.3g}"
            # after the older of two forwards' backward, the newer one's outputs wait for its own backward
            waiting = rows["plain"]["fwd_a2a"] if row == "older_first" else 0
            assert d["kept"] == waiting, f"{name} rank {rank} {row}: {d['kept']} collective outputs kept after the step"
        plain = rows["plain"]["bwd_a2a"]
        assert plain == rows["plain"]["fwd_a2a"] > 0, rows["plain"]       # each switch's backward is one switch
        for row in fresh:  # the recompute issued nothing
            assert rows[row]["bwd_a2a"] == plain, (name, rank, row, rows[row], plain)
        assert rows["plain"]["kept_after_forward"] == 0, rows["plain"]    # no checkpointing: nothing kept


@pytest.mark.parametrize("n", [2, 4])
def test_wan_recompute_issues_no_head_switch(n: int) -> None:
    results = run_distributed(_wan, n)
    _check("wan", n, results, ("checkpointed", "after_dropped_forward", "newer_second"))
    for rows in results:
        plain = rows["plain"]["bwd_a2a"]
        assert rows["checkpointed"]["kept_after_forward"] == plain, rows    # each head switch's output
        # the older of two forwards in flight keeps nothing: its recompute runs its collectives (exact)
        assert rows["older_first"]["bwd_a2a"] == 2 * plain, rows["older_first"]
        assert rows["reentrant"]["bwd_a2a"] == 2 * plain, rows["reentrant"]


def test_latte_recompute_issues_no_switch() -> None:
    results = run_distributed(_latte, 2)
    _check("latte", 2, results, ("checkpointed", "no_early_stop"))
    for rows in results:
        # a switch after a block ends its region: with early stop it is never recomputed, so not kept
        assert rows["checkpointed"]["kept_after_forward"] == 0, rows
        assert rows["no_early_stop"]["kept_after_forward"] == rows["plain"]["fwd_a2a"], rows


# --------------------------------------------------------------------------- a user's own checkpoint, reentrant too


class _Checkpointed(nn.Module):
    """A block checkpointed by the user's own ``torch.utils.checkpoint`` (the plan's hooks run inside)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return checkpoint(self.inner.__call__, x, *rest, use_reentrant=self.reentrant)


# docs/models.md's two plans, with each block's path one level down (the wrapper); VideoViT splits on the
# wrapper, outside the checkpointed region
_EXAMPLES = {
    "factorized": (DividedSpaceTime, ("spatial", "temporal"), {
        "": Grid(B=("video", 0)),
        "embed": Split("out", "(B T) S D", shard="T"),
        "spatial.*.inner": Block("(B T) S D", attends="S", then="T", out_shard="S", follow={"cond": "(B T)"}),
        "temporal.*.inner": Block("(B S) T D", attends="T", then="S", out_shard="T"),
        "out": Gather(0, "(B T) S D")}),
    "full_3d": (VideoViT, ("blocks",), {
        "blocks.0": Split("x", "B L D", shard="L"),
        "blocks.*.inner": Block("B L D", arg="x"),
        "blocks.*.inner.attn": Heads(),
        "norm": Gather(0, "B L D")}),
}


def _example_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], parallel: bool) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    video = inputs[0].clone().requires_grad_(True)
    with CommAccounting(activations=False) as acct:
        out = model(video, *inputs[1:])
        out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    dx = video.grad.clone()
    if parallel:
        reduce_gradients(model.parameters())
        grads = [p.grad.clone() for p in model.parameters()]
        dist.all_reduce(dx)
    return {"out": out.detach(), "dx": dx, "grads": grads, "bwd_a2a": acct.count("all_to_all", "backward"),
            "bwd_collectives": acct.count(phase="backward"), "kept": recompute.kept()}


def _examples(rank: int, n: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(3)
    video = torch.randn(2, 5, 9, 4, generator=g, dtype=torch.float64)     # 5 frames, 9 patches: uneven on 2
    rows = {}
    for name, (cls, lists, plan) in _EXAMPLES.items():
        inputs = (video,) if cls is VideoViT else (video, torch.randn(2, 5, 16, generator=g, dtype=torch.float64))
        ref = _example_step(cls().double(), inputs, parallel=False)
        for mode in ("plain", "non_reentrant", "reentrant", "whole_model"):
            model = cls().double()
            if mode in ("non_reentrant", "reentrant"):
                for attr in lists:
                    blocks = getattr(model, attr)
                    for i in range(len(blocks)):
                        blocks[i] = _Checkpointed(blocks[i], reentrant=mode == "reentrant")
            wrapped = plan if "reentrant" in mode else {k.replace(".inner", ""): v for k, v in plan.items()}
            model = dsp_plugin.parallelize(model, wrapped)
            if mode == "whole_model":  # one region: the entry split, every switch and the exit gather inside
                model = _Checkpointed(model, reentrant=False)
            got = _example_step(model, inputs, parallel=True)
            rows[f"{name} {mode}"] = {"out": (got["out"] - ref["out"]).abs().max().item(),
                                      "dx": (got["dx"] - ref["dx"]).abs().max().item(),
                                      "grads": max((a - b).abs().max().item() for a, b in zip(got["grads"],
                                                                                               ref["grads"])),
                                      "bwd_a2a": got["bwd_a2a"], "bwd_collectives": got["bwd_collectives"],
                                      "kept": got["kept"]}
    return rows


def test_user_checkpoint_reentrant_and_not_exact() -> None:
    for rank, rows in enumerate(run_distributed(_examples, 2)):
        for row, d in rows.items():
            print(f"rank {rank} {row}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
            for key in ("out", "dx", "grads"):
                assert d[key] < 1e-12, f"rank {rank} {row}: {key} {d[key]:.3g}"
            assert d["kept"] == 0, (row, d)
        for name in _EXAMPLES:
            plain = rows[f"{name} plain"]["bwd_a2a"]
            assert plain > 0 and rows[f"{name} non_reentrant"]["bwd_a2a"] == plain, (name, rows)
            # the whole model in one region: no switch and no gather re-issued (a gather's backward is local)
            assert rows[f"{name} whole_model"]["bwd_collectives"] == rows[f"{name} plain"]["bwd_collectives"] == plain
        # reentrant: the forward runs without grad, nothing is kept, the recompute runs the head switches
        assert rows["full_3d reentrant"]["bwd_a2a"] == 2 * rows["full_3d plain"]["bwd_a2a"], rows


# --------------------------------------------------------------------------- the replay's own backward


class _GradOnCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint whose forward keeps grad on (saved tensors packed by hooks), so the forward keeps
    the switch's output and the recompute, which backward differentiates, replays it: the replay's backward
    must be the switch's own (torch's and diffusers' checkpoints never differentiate a replay)."""

    @staticmethod
    def forward(ctx: Any, fn: Any, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.fn = fn
        ctx.save_for_backward(h)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return fn(h.detach().requires_grad_(True)).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        (h,) = ctx.saved_tensors
        h = h.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.fn(h)                                # the recompute: the switch is replayed
        torch.autograd.backward(out, grad)                 # through the replay's backward
        return None, h.grad


def _region(w1: torch.Tensor, w2: torch.Tensor) -> Any:
    def region(h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(h @ w1)
        h = recompute.replay(("region", "switch"), lambda u: dynamic_switch(u, 1, 2), h)  # S(1) -> S(2)
        return torch.tanh(h @ w2) ** 2
    return region


def _replay_backward(rank: int, n: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 5, 4, generator=g, dtype=torch.float64)    # [B, T, S, D], uneven T and S on 2 ranks
    w = [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    result: dict[str, float] = {}
    for mode in ("plain", "replayed"):
        w1, w2 = (p.clone().requires_grad_(True) for p in w)
        xs = x.clone().requires_grad_(True)
        recompute.forward_starts()                         # what a parallelized model's forward does
        h = split(xs, 1)
        y = _GradOnCheckpoint.apply(_region(w1, w2), h) if mode == "replayed" else _region(w1, w2)(h)
        with CommAccounting(activations=False) as acct:
            gather(y, 2).sum().backward()
        result[mode] = [xs.grad, w1.grad, w2.grad]
        result[f"{mode}_bwd_a2a"] = acct.count("all_to_all", "backward")
    plain, replayed = result.pop("plain"), result.pop("replayed")
    result["diff"] = max((a - b).abs().max().item() for a, b in zip(plain, replayed))
    result["norm"] = min(a.norm().item() for a in plain)
    result["kept"] = recompute.kept()
    return result


def test_replay_backward_is_the_switch_backward() -> None:
    for d in run_distributed(_replay_backward, 2):
        print(d)
        # plain: the switch's backward; replayed: the recompute issues no switch, its backward is one switch
        assert d["plain_bwd_a2a"] == d["replayed_bwd_a2a"] == 1, d
        assert d["norm"] > 0.1 and d["diff"] < 1e-12 and d["kept"] == 0, d
