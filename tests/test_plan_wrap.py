"""The plan's hooks run from a wrapper set as each planned module's ``forward`` (``dsp_plugin.plan.wrap``), not from
torch's hooks: a forward replaced after ``parallelize`` is wrapped again (the plan keeps applying, as a torch hook
would), a wrapper set over the plan's keeps it inside, ``remove_plan`` gives every module its forward back, and an
error in a forward closes what the plan's pre-hook opened. Checked against the one-process model on 2 gloo ranks.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.distributed import run_distributed

SIZE = (2, 4, 8, 4, 8)  # the quick Wan: 64 tokens, 4 heads; 4 frames over 2 ranks


def _replaced_and_removed(rank: int, world_size: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.plan.runtime import remove_plan

    reference, batch = _setup(SIZE)
    group = torch.distributed.group.WORLD
    model = dsp_plugin.parallelize(copy.deepcopy(reference), group=group)
    attn = model.blocks[0].attn1
    wrapper = attn.forward
    calls: list[int] = []

    def patched(*args: object, **kwargs: object) -> object:  # a user's patch: counts, then the class's forward
        calls.append(1)
        return type(attn).forward(attn, *args, **kwargs)

    attn.forward = patched  # replaces the plan's wrapper on the instance
    with torch.no_grad():
        expected = reference(*batch, return_dict=False)[0]
        replaced = model(*batch, return_dict=False)[0]
    out: dict[str, object] = {"replaced": (replaced - expected).abs().max().item(), "calls": len(calls),
                              "rewrapped": attn.__dict__["forward"] is wrapper and wrapper.inner is patched}

    block = model.blocks[1]
    own = block.forward

    @functools.wraps(own)
    def over(*args: object, **kwargs: object) -> object:  # a framework's wrapper over the plan's (diffusers' hooks)
        return own(*args, **kwargs)

    block.forward = over
    with torch.no_grad():
        wrapped_over = model(*batch, return_dict=False)[0]
    out["wrapped_over"] = (wrapped_over - expected).abs().max().item()
    out["kept"] = block.__dict__["forward"] is over

    remove_plan(model)
    with torch.no_grad():
        removed = model(*batch, return_dict=False)[0]  # every rank the whole model: the one-process output
    out["removed"] = (removed - expected).abs().max().item()
    out["restored"] = ("forward" not in model.rope.__dict__ and "forward" not in model.proj_out.__dict__
                       and attn.__dict__["forward"] is patched and not own.active)
    return out


def test_a_replaced_forward_is_wrapped_again_and_remove_plan_restores_every_forward() -> None:
    for rank, r in enumerate(run_distributed(_replaced_and_removed, 2, world_topology=False)):
        assert r["rewrapped"] and r["calls"] == 1, (rank, r)
        assert r["kept"] and r["restored"], (rank, r)
        for key in ("replaced", "wrapped_over", "removed"):
            assert r[key] < 1e-5, (rank, key, r)


def test_an_error_in_a_planned_forward_closes_what_its_hooks_opened() -> None:
    """torch's ``always_call`` semantics: the plan's post-hook runs after the forward raised (the ``Heads`` call
    and the block's frame are closed), and the forward's own error is the one raised."""
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.fake_world import fake_world
    from dsp_plugin.plan.attention import current_call
    from dsp_plugin.plan.frames import frames

    with fake_world(2, dsp=2), torch.no_grad():
        reference, batch = _setup(SIZE)
        model = dsp_plugin.parallelize(copy.deepcopy(reference))
        model(*batch, return_dict=False)
        attn = model.blocks[1].attn1

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("the model's own bug")

        attn.forward.inner, attn.forward.call = broken, broken  # the wrapper stays: its forward raises
        with pytest.raises(RuntimeError, match="the model's own bug"):
            model(*batch, return_dict=False)
        assert current_call() is None and frames() == []


def test_the_hooks_are_not_torch_hooks() -> None:
    """A planned module has no torch forward hook (its calls take torch's fast path); the model itself keeps its
    own two (they open and close the forward's frame) and ``every_gradient``'s."""
    import dsp_plugin
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.plan.wrap import Forward, wrappers

    model = dsp_plugin.parallelize(copy.deepcopy(_setup(SIZE)[0]))
    planned = [m for m in model.modules() if type(m.__dict__.get("forward")) is Forward]
    assert len(planned) == len(wrappers(model)) == 1 + 2 * 2 + 1  # rope, each block and its attn1, proj_out
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in planned)
    assert model._forward_pre_hooks and model._forward_hooks
