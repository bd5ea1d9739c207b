"""What the plan runtime computes once and reuses on every call (issue 28, item 3: the runtime's own Python).

A ``Heads`` call's placement (lengths, its place in the group, the switch's axes) is computed once per
placement and shared by the calls that have it; a tag (``ShardSpec``) is one object per placement; a
``Layout`` knows its axes and where each is. These tests pin what is shared and what must not be: a call's
group is its own (a cache never keeps a process group alive), another rank or length gets its own entry,
and a shape not seen before is checked again. Single process, no collective.
"""

from __future__ import annotations

import copy
import pickle

import pytest

from dsp_plugin.plan import attention, ops
from dsp_plugin.plan.spec import Layout


def test_layout_axes_and_dims_survive_copy_and_pickle() -> None:
    lay = Layout.parse("B (F H W) D")
    assert lay.axes == ("B", "F", "H", "W", "D")
    assert [lay.dim_of(a) for a in lay.axes] == [0, 1, 1, 1, 2]
    for other in (copy.deepcopy(lay), pickle.loads(pickle.dumps(lay)), Layout.parse("B (F H W) D")):
        assert other == lay and hash(other) == hash(lay)
        assert other.axes == lay.axes and other.dim_of("W") == 1
    assert repr(lay) == "Layout(dims=(('B',), ('F', 'H', 'W'), ('D',)))"
    with pytest.raises(ValueError, match="axis 'T' is not in layout B \\(F H W\\) D"):
        lay.dim_of("T")


def test_a_tag_is_found_on_a_detached_alias_however_late_it_is_asked() -> None:
    """Tags are keyed for the lookup by alias lazily (``layout._pending``): what the lookup finds is what it found
    when every tag was keyed at once."""
    import gc

    import torch

    from dsp_plugin import layout

    x = torch.randn(4, 6)
    layout.attach(x, 0, 8)
    y = x.detach()  # an alias (what reentrant checkpointing recomputes on): the same view, a new object, no tag
    assert layout.shard_spec(y) == layout.ShardSpec(0, 8)
    assert layout.shard_spec(x[1:].detach()) is None  # another view of the same memory: not the same shard
    again = x.detach()
    layout.attach(again, 0, 9)  # the same view tagged later: the later tag wins
    assert layout.shard_spec(x.detach()) == layout.ShardSpec(0, 9)
    del x, again
    gc.collect()
    assert layout.shard_spec(y) is None  # the tagged tensors are gone: so are their keys
    assert not any(ref() is None for ref in layout._aliases.values())
    z = torch.randn(4, 6)
    layout.attach(z, 0, 8)  # keyed by its first element's address, shape, strides, dtype and device:
    assert layout.shard_spec(z.detach()) == layout.ShardSpec(0, 8)
    assert layout.shard_spec(z.detach().view(-1)) is None  # the same first element, another shape
    assert layout.shard_spec(z.detach().view(torch.int32)) is None  # another dtype
    assert layout.shard_spec(z.detach().t().t()) == layout.ShardSpec(0, 8)  # the same view, made another way
    assert layout.shard_spec(z[0:0].detach()) is None  # empty: no identity
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake storages have no address: keyed by the storage object and offset
        f = torch.empty(4, 6)
        layout.attach(f, 0, 8)
        assert layout.shard_spec(f.detach()) == layout.ShardSpec(0, 8)
        assert layout.shard_spec(f[1:].detach()) is None and layout.shard_spec(torch.empty(4, 6)) is None
    for _ in range(3 * layout._PENDING_LIMIT):  # a loop that never looks up: the pending list stays bounded
        layout.attach(torch.randn(3), 0, 6)
    assert len(layout._pending) <= layout._PENDING_LIMIT


def test_a_tag_is_one_object_per_placement() -> None:
    lay = Layout.parse("B (F HW) D")
    a = ops.spec_for(lay, {"B": 1, "F": 5, "HW": 6, "D": 8}, "F")
    assert a is ops.spec_for(lay, {"B": 2, "F": 5, "HW": 6, "D": 16}, "F")  # whole dims are not in the tag
    b = ops.spec_for(lay, {"B": 1, "F": 7, "HW": 6, "D": 8}, "F")
    assert b is not a and (b.dim, b.global_len, b.grid, b.axis) == (1, 42, (7, 6), 0)
    assert (a.dim, a.global_len, a.grid, a.axis) == (1, 30, (5, 6), 0)


def test_heads_calls_share_their_placement_but_not_their_group() -> None:
    group = object()  # stands for a process group: never kept by the cache
    first = attention.HeadsCall("blocks.0.attn1", [(3, 5), (6, 6)], 0, group, members=(2, 0))
    again = attention.HeadsCall("blocks.0.attn1", [(3, 5), (6, 6)], 0, group, members=(2, 0))
    other = attention.HeadsCall("blocks.0.attn1", [(2, 5), (6, 6)], 0, group, members=(2, 1))
    assert first.checked is again.checked and first.heads_of is again.heads_of
    assert other.checked is not first.checked
    assert (first.rank, first.mine, first.total) == (0, 18, 30) and (other.rank, other.mine) == (1, 12)
    # 5 frames on 2 ranks do not split evenly: the switch unfolds (F HW) and runs on F
    assert (first.switch_local, first.switch_full, first.switch_axis) == ([3, 6], [5, 6], 0)
    even = attention.HeadsCall("blocks.0.attn1", [(2, 4), (6, 6)], 0, group, members=(2, 0))
    assert (even.switch_local, even.switch_full, even.switch_axis) == ([12], [24], 0)
    assert first.group is group and first.attended == 0 and first.in_kernel is False
    assert all(value is not group for fixed in attention._FIXED.values() for value in fixed.values())
    first.attended = 2  # per-call state stays per call
    assert again.attended == 0


def _changing_shapes(rank: int, n: int) -> dict[str, float | int]:
    """Wan and Latte on 2 gloo ranks, called with lengths that change from call to call (what a sampling loop of
    several resolutions does): each output is the one-process one, whatever the runtime kept from earlier calls."""
    import torch

    import dsp_plugin
    from dsp_plugin.plan import attention as heads
    from dsp_plugin.testing.tiny import tiny_latte, tiny_wan

    result: dict[str, float | int] = {}
    for name, reference in (("wan", tiny_wan(layers=2, heads=3, head_dim=8).double()),
                            ("latte", tiny_latte(frames=5, layers=2, heads=3, head_dim=4, sample_size=6).double())):
        model = dsp_plugin.parallelize(copy.deepcopy(reference))
        rt = model._dsp_plan_runtime
        worst = 0.0
        # frames (latte: fixed by its positional table), side, batch; the first shape comes back at the end
        shapes = [(5, 6, 2), (3, 4, 1), (5, 6, 2), (4, 6, 2), (5, 6, 2)] if name == "wan" else \
            [(5, 6, 2), (5, 4, 1), (5, 6, 2)]
        for i, (frames, side, batch) in enumerate(shapes):
            g = torch.Generator().manual_seed(i)
            channels = 4
            latents = torch.randn(batch, channels, frames, side, side, generator=g, dtype=torch.float64)
            timestep = torch.tensor([3, 700][:batch])
            text = torch.randn(batch, 7, 16, generator=g, dtype=torch.float64)
            grad = torch.is_grad_enabled() if i % 2 else False
            with torch.set_grad_enabled(grad):
                want = reference(latents, timestep, text, return_dict=False)[0]
                got = model(latents, timestep, text, return_dict=False)[0]
            worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
        result[f"{name}_error"] = worst
        result[f"{name}_splits"] = len(rt.splits)
        result[f"{name}_tags"] = len(rt.tag_placed)
    result["heads_placed"] = sum(path.endswith("attn1") for path in heads._PLACED)
    return result


def test_the_runtime_s_caches_follow_changing_shapes() -> None:
    """The runtime keeps what a placement fixes (a split's grid and rows, a block input's placement read from its
    tag, a Heads call's lengths) and reuses it while the call is the same; a call of other lengths must get its
    own, never the last one's. Wan (folded ``(F HW)``, tag holds every length) and Latte (``(B T) S D``, whose tags
    lack the folded batch: read and completed on every call, never kept)."""
    from tests.distributed import run_distributed

    for rank, d in enumerate(run_distributed(_changing_shapes, 2)):
        assert d["wan_error"] < 1e-12 and d["latte_error"] < 1e-12, (rank, d)
        # per shape (3): rope's cos, its sin (the grid known by then is the cos's: another key), the first block's
        # tokens; one tag entry per block (proj_out's output is untagged: none)
        assert (d["wan_splits"], d["wan_tags"]) == (3 * 3, 2), d
        assert d["heads_placed"] >= 2, d  # Wan's 2 self-attentions at least (Latte's too)


def _saved_whole(rank: int, n: int) -> float:
    import io

    import torch

    import dsp_plugin
    from dsp_plugin.testing.tiny import tiny_wan

    model = dsp_plugin.parallelize(tiny_wan(layers=1, heads=3, head_dim=8).double())
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(1, 4, 4, 4, 4, generator=g, dtype=torch.float64), torch.tensor([3]),
             torch.randn(1, 5, 16, generator=g, dtype=torch.float64))
    with torch.no_grad():
        before = model(*batch, return_dict=False)[0]
        buffer = io.BytesIO()
        torch.save(model, buffer)  # after a forward: with what the hooks keep across forwards
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded._dsp_plan_runtime.splits == {} and model._dsp_plan_runtime.splits
        return (loaded(*batch, return_dict=False)[0] - before).abs().max().item()


def test_a_parallelized_model_saved_whole_after_a_forward_loads_and_runs() -> None:
    """``torch.save(model)`` of a whole parallelized model pickles its runtime: not what the hooks keep across
    forwards (dropped, refilled by the next forward), and nothing that cannot be pickled."""
    from tests.distributed import run_distributed

    assert run_distributed(_saved_whole, 2) == [0.0, 0.0]


def test_only_the_hooks_that_act_are_registered() -> None:
    """A module call with a hook costs the hook's call: ``parallelize`` sets a pre-hook only where a spec acts before
    the call, a post-hook only where one acts after it."""
    import torch

    import dsp_plugin
    from dsp_plugin.bench.wan import QUICK, _setup

    torch.manual_seed(0)
    model = dsp_plugin.parallelize(_setup(QUICK)[0])  # the built-in WAN_PLAN; no forward, no process group

    def counts(module: torch.nn.Module) -> tuple[int, int]:
        # the plan's hooks run around the module's forward (plan/wrap.py), none through torch's hook dispatch
        assert not module._forward_pre_hooks and not module._forward_hooks
        wrapper = module.__dict__.get("forward")
        return (0, 0) if wrapper is None else (int(wrapper.pre is not None), int(wrapper.post is not None))

    assert counts(model.proj_out) == (0, 1)  # Gather("out"): after the call only
    assert counts(model.rope) == (1, 1)  # Positions before, Split("out") after
    assert counts(model.blocks[0]) == (1, 1) and counts(model.blocks[0].attn1) == (1, 1)  # Block, Heads
    assert counts(model.blocks[0].attn2) == (0, 0)  # not in the plan
