"""The plan vocabulary and the runtime's checks, on one process (no collective involved)."""

from __future__ import annotations

import pytest
import torch

import dsp_plugin
from dsp_plugin.plan import Block, Gather, Grid, Heads, Layout, Split
from dsp_plugin.plan.runtime import expand
from dsp_plugin.testing.examples import DividedSpaceTime, VideoViT


def test_layout_parse() -> None:
    lay = Layout.parse("(B T) S D")
    assert lay.dims == (("B", "T"), ("S",), ("D",)) and lay.dim_of("T") == 0 and str(lay) == "(B T) S D"
    for bad, match in [("(B (T) S", "nested"), ("B T) S", "unopened"), ("(B T S", "unclosed"), ("B B", "twice")]:
        with pytest.raises(ValueError, match=match):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="axis 'X' is not in layout"):
        Split("out", "(B T) S D", shard="X")


def test_wildcards_expand_over_module_lists() -> None:
    plan = {"spatial.*": Block("(B T) S D", attends="S"), "temporal.1": Block("(B S) T D")}
    paths = [p for p, _, _ in expand(DividedSpaceTime(), plan)]
    assert paths == ["spatial.0", "spatial.1", "temporal.1"]


@pytest.mark.parametrize("plan, error, match", [
    ({"blocks.*.nothing": Heads()}, ValueError, "'blocks.\\*.nothing' matches no module of VideoViT"),
    ({"blocks.0": "split"}, TypeError, "expected Split, Block, Heads, Gather or Grid"),
    ({"blocks.0": Grid(B=("video", 0))}, ValueError, "Grid belongs to the model itself"),
])
def test_bad_plans_are_named(plan: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        dsp_plugin.parallelize(VideoViT(), plan)


def test_no_plan_and_twice() -> None:
    with pytest.raises(ValueError, match="no built-in plan for Linear"):
        dsp_plugin.parallelize(torch.nn.Linear(2, 2))
    model = dsp_plugin.parallelize(VideoViT(), {"norm": Gather(0, "B L D")})
    with pytest.raises(ValueError, match="already parallelized"):
        dsp_plugin.parallelize(model, {"norm": Gather(0, "B L D")})


def test_one_process_is_the_model_and_keeps_its_parameters() -> None:
    model = VideoViT()
    names = [n for n, _ in model.named_parameters()]
    out = dsp_plugin.parallelize(model, {"blocks.0": Split("x", "B L D", shard="L"),
                                         "blocks.*": Block("B L D", arg="x"), "blocks.*.attn": Heads(),
                                         "norm": Gather(0, "B L D")})
    assert out is model and [n for n, _ in model.named_parameters()] == names
    video = torch.randn(2, 3, 4, 4)
    assert torch.equal(model(video), VideoViT()(video))
