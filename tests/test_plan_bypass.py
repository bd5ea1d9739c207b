"""A pass-through block (a ``Block`` alone, no ``attends``, ``out_shard`` or ``follow``: every block of Wan's plan)
runs without its hooks in a forward without autograd, where the frame holds the placement a block of its layout
handed on (``_Runtime.bypass``); its ``Heads`` modules read the placement from the frame. Checked on 2 gloo ranks
against the one-process model: which blocks ran their hooks, and that the output is the same, in sampling (no
autograd: left out; an EMA copy too), in training (run: a recompute would look for the tags), under ``DSP_CHECK=1``
(run), where a split of another stream moved the frame between two blocks (run: the frame is not the block's
placement), and where a block is given a tensor of another stream, tagged before (run: its tag is not the one the
frame's placement came with).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed

SIZE = (3, 4, 8, 4, 8)  # the quick Wan, 3 blocks: 64 tokens, 4 heads; 4 frames over 2 ranks


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(dim), _Attention(dim, heads)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x)) + context.mean(1, keepdim=True)


class _TwoStreams(nn.Module):
    """Blocks over the video tokens; between the first two, a text projection (6 tokens) the plan splits on its own
    axis (it moves the frame to the text's placement), whose output the next blocks read as a mean (sampling only:
    the sum over the group is not differentiated)."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(dim, heads) for _ in range(3)])
        self.text = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        context = torch.zeros_like(x[:, :1])
        for i, block in enumerate(self.blocks):
            x = block(x, context)
            if i == 0:
                rows = self.text(text)
                context = rows.sum(1, keepdim=True)  # this rank's rows, summed over the group: all 6
                if rows.shape[1] < 6:  # a shard
                    from dsp_plugin.comm.collectives import all_reduce_sum

                    all_reduce_sum(context, group=None)
                context = context / 6
        return x


class _TwoVideos(nn.Module):
    """Two videos of 4 frames of 2 tokens through blocks of one plan entry: ``z`` is split first, by its tokens
    within a frame, ``x`` by frames and runs through blocks 0 and 1, then ``z`` through block 2: the frame holds
    ``x``'s placement there (the same number of tokens per rank), ``z`` its own tag."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(dim, heads) for _ in range(3)])
        self.zin, self.gx, self.gz = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, z: torch.Tensor, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, context = self.zin(z), torch.zeros_like(x[:, :1])
        x = self.blocks[1](self.blocks[0](x, context), context)
        z = self.blocks[2](z, context)
        return self.gx(x), self.gz(z)


def _two_videos_plan() -> dict[str, object]:
    from dsp_plugin.plan import Block, Gather, Grid, Heads, Split

    return {"": Grid(F=("frames", 0)), "zin": Split("out", "B (F S) D", shard="S"),
            "blocks.0": Split("x", "B (F S) D", shard="F"), "blocks.*": Block("B (F S) D", arg="x"),
            "blocks.*.attn": Heads(), "gx": Gather("out", "B (F S) D"), "gz": Gather("out", "B (F S) D")}


def _two_streams_plan() -> dict[str, object]:
    from dsp_plugin.plan import Block, Gather, Heads, Split

    return {"blocks.0": Split("x", "B L D", shard="L"), "blocks.*": Block("B L D", arg="x"),
            "blocks.*.attn": Heads(), "blocks.2": Gather("out", "B L D"), "text": Split(0, "B T D", shard="T")}


def _ran(model: nn.Module, paths: list[str]) -> dict[str, list[int]]:
    """Count each call of the named modules' plan pre-hooks."""
    counts: dict[str, list[int]] = {}
    for path in paths:
        wrapper = model.get_submodule(path).__dict__["forward"]
        pre, seen = wrapper.pre, counts.setdefault(path, [])

        def counted(*args: object, _pre: object = pre, _seen: list[int] = seen) -> object:
            _seen.append(1)
            return _pre(*args)

        wrapper.pre = counted
    return counts


def _bypass(rank: int, world_size: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin import checks
    from dsp_plugin.bench.wan import _setup
    from dsp_plugin.plan.wrap import wrappers

    out: dict[str, object] = {}
    reference, batch = _setup(SIZE)
    model = dsp_plugin.parallelize(copy.deepcopy(reference), group=torch.distributed.group.WORLD)
    out["passing"] = sorted(p for p in ("blocks.0", "blocks.1", "blocks.2")
                            if model.get_submodule(p).__dict__["forward"].bypass is not None)
    out["wrappers"] = len(wrappers(model))
    ema = copy.deepcopy(model)  # an EMA copy samples with its own runtime: its blocks pass the placement on too
    counts = _ran(model, ["blocks.0", "blocks.1", "blocks.2"])
    with torch.no_grad():
        expected = reference(*batch, return_dict=False)[0]
        sampled = model(*batch, return_dict=False)[0]
    out["sampling"] = ((sampled - expected).abs().max().item(), {k: len(v) for k, v in counts.items()})
    for v in counts.values():
        v.clear()
    trained = model(*batch, return_dict=False)[0]
    trained.sum().backward()
    out["training"] = ((trained.detach() - expected).abs().max().item(), {k: len(v) for k, v in counts.items()})
    for v in counts.values():
        v.clear()
    checks.set_check_mode("always")
    try:
        with torch.no_grad():
            checked = model(*batch, return_dict=False)[0]
    finally:
        checks.set_check_mode(None)
    out["checked"] = ((checked - expected).abs().max().item(), {k: len(v) for k, v in counts.items()})
    counts = _ran(ema, ["blocks.1", "blocks.2"])
    with torch.no_grad():
        copied = ema(*batch, return_dict=False)[0]
    out["copy"] = ((copied - expected).abs().max().item(), {k: len(v) for k, v in counts.items()})

    torch.manual_seed(0)
    streams, x, text = _TwoStreams(), torch.randn(2, 8, 16), torch.randn(2, 6, 16)
    plain = copy.deepcopy(streams)
    with torch.no_grad():
        expected = plain(x, text)
        parallel = dsp_plugin.parallelize(streams, _two_streams_plan(), group=torch.distributed.group.WORLD)
        counts = _ran(parallel, ["blocks.1"])
        got = parallel(x, text)
    out["streams"] = ((got - expected).abs().max().item(), len(counts["blocks.1"]))

    torch.manual_seed(0)
    videos, x, z, frames = _TwoVideos(), torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.zeros(4)
    plain = copy.deepcopy(videos)
    with torch.no_grad():
        expected = plain(x, z, frames)
        parallel = dsp_plugin.parallelize(videos, _two_videos_plan(), group=torch.distributed.group.WORLD)
        counts = _ran(parallel, ["blocks.1", "blocks.2"])
        got = parallel(x, z, frames)
    out["videos"] = (max((g - e).abs().max().item() for g, e in zip(got, expected)),
                     {k: len(v) for k, v in counts.items()})
    return out


# what each case checks: the largest difference to one process, and which blocks ran their hooks
CASES = {
    "passing": "Wan's plan: the blocks that pass through (blocks.0 splits its input)",
    "sampling": "Wan sampled without autograd: blocks.1 and blocks.2 run without their hooks",
    "training": "Wan with autograd: a recompute reads the tags, every block runs its hooks",
    "checked": "Wan under DSP_CHECK=1: every block runs its hooks",
    "copy": "an EMA copy of Wan sampled without autograd: its own runtime passes the placement on",
    "streams": "a text split between two blocks moved the frame: blocks.1 runs its hooks",
    "videos": "a block given a tensor of another stream, tagged before: blocks.2 runs its hooks",
}
EXPECTED = {"passing": ["blocks.1", "blocks.2"],
            "sampling": {"blocks.0": 1, "blocks.1": 0, "blocks.2": 0},
            "training": {"blocks.0": 1, "blocks.1": 1, "blocks.2": 1},
            "checked": {"blocks.0": 1, "blocks.1": 1, "blocks.2": 1},
            "copy": {"blocks.1": 0, "blocks.2": 0},
            "streams": 1,
            "videos": {"blocks.1": 0, "blocks.2": 1}}


def test_a_pass_through_block_runs_without_its_hooks_only_where_nothing_needs_them() -> None:
    failures = []
    for rank, r in enumerate(run_distributed(_bypass, 2, world_topology=False)):
        if r["passing"] != EXPECTED["passing"]:
            failures.append(f"{CASES['passing']}, rank {rank}/2: {r['passing']} pass through; expected "
                            f"{EXPECTED['passing']}")
        for key in [k for k in CASES if k != "passing"]:
            diff, ran = r[key]
            if not diff < 1e-5:
                failures.append(f"{key} ({CASES[key]}), rank {rank}/2: the output differs from one process by "
                                f"{diff:.3g}; expected < 1e-5")
            if ran != EXPECTED[key]:
                failures.append(f"{key} ({CASES[key]}), rank {rank}/2: hooks ran {ran}; expected {EXPECTED[key]}")
    assert not failures, "\n".join(failures)
