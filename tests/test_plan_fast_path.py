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
