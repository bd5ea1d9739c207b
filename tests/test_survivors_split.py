"""The plan's split, gather and per-row split, bit-exact on 2 ranks as well as 4 (issue 29's narrow split catch).

A plan split bug was caught only on 4 ranks: the 2-rank runs used lengths whose
halves hid it. Here every axis is odd and the axes differ (B = 2, T = 5, S = 7),
so on 2 ranks the chunks differ in size (3, 2 and 4, 3) and in offset, and each
layout folds the sharded axis behind another one ("(B T)": T inside B) or in front
("(T S)": S inside T). Against ``tensor_split`` of the full tensor, one process's
arithmetic: ``plan_split`` (values; backward: this rank's rows, zeros elsewhere),
``plan_gather`` (values back to the full tensor), ``split_rows`` (a ``Block``'s
per-row conditioning) and ``infer_grid`` (the global lengths from a shard).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsp_plugin.plan import ops
from dsp_plugin.plan.placement import split_rows
from dsp_plugin.plan.spec import Layout
from tests.distributed import run_distributed

GRID = {"B": 2, "T": 5, "S": 7, "D": 3}
#: (layout, sharded axis, per-row conditioning layout or None)
CASES = [("(B T) S D", "T", "(B T)"), ("(B T) S D", "S", None), ("B (T S) D", "T", None), ("B (T S) D", "S", None),
         ("(B S) T D", "T", "(B S)"), ("(B S) T D", "S", "(B S)")]


def _cases(rank: int, n: int) -> list[str]:
    """Every mismatch found on this rank, as a sentence naming the case, the quantity and the rank."""
    wrong: list[str] = []
    for text, shard, rows_text in CASES:
        lay = Layout.parse(text)
        axes = [a for names in lay.dims for a in names]
        unfolded = [GRID[a] for a in axes]
        full = torch.arange(math.prod(unfolded), dtype=torch.float64).reshape(unfolded)
        folded_shape = [math.prod(GRID[a] for a in names) for names in lay.dims]
        x = full.reshape(folded_shape).requires_grad_(True)
        mine = full.tensor_split(n, dim=axes.index(shard))[rank]
        expected = _fold(mine, lay)
        where = f"'{text}' sharded on {shard} (lengths {GRID}), rank {rank} of {n}"
        grid = {a: GRID[a] for a in axes if a != "D"}
        try:  # no collective inside: a rank that raises here reports it instead of leaving its peers waiting
            local = ops.plan_split(where, x, lay, grid, shard, None)
        except (IndexError, RuntimeError, ValueError) as exc:
            wrong.append(f"{where}: plan_split raised {type(exc).__name__}: {exc}")
            local = expected.clone().requires_grad_(True)
        if local.shape != expected.shape:
            wrong.append(f"{where}: plan_split gave shape {tuple(local.shape)}, expected {tuple(expected.shape)} "
                         f"(tensor_split of the full tensor)")
            local = expected.clone().requires_grad_(True)  # every rank runs the same collectives below
        elif not torch.equal(local, expected):
            wrong.append(f"{where}: plan_split gave rows starting {local.flatten()[:3].tolist()}, expected "
                         f"{expected.flatten()[:3].tolist()} (tensor_split's chunk of the full tensor)")
        local.backward(torch.ones_like(local))
        mask = torch.zeros_like(full)
        mask.tensor_split(n, dim=axes.index(shard))[rank].fill_(1)
        if x.grad is not None and not torch.equal(x.grad, mask.reshape(folded_shape)):
            wrong.append(f"{where}: plan_split's backward is not 1 on this rank's rows and 0 elsewhere")
        drop = next(a for a in lay.dims[0] if a != shard)   # one length left for infer_grid to find
        try:  # the lengths only, no collective
            inferred = ops.infer_grid(where, local.detach(), lay, {a: v for a, v in grid.items() if a != drop},
                                      shard=shard)
        except ValueError as exc:
            inferred = {"raised": str(exc)}
        if any(inferred.get(a) != GRID[a] for a in grid):
            wrong.append(f"{where}: infer_grid from the shard gave {inferred}, expected {grid}")
        gathered = ops.plan_gather(where, local.detach(), lay, grid, shard, None)
        if not torch.equal(gathered, x.detach()):
            wrong.append(f"{where}: plan_gather of the shard is not the full tensor")
        if rows_text is not None and shard in Layout.parse(rows_text).dims[0]:
            rows = Layout.parse(rows_text)
            names = rows.dims[0]
            cond = torch.arange(math.prod(GRID[a] for a in names) * 2, dtype=torch.float64).reshape(
                *[GRID[a] for a in names], 2)
            want = cond.tensor_split(n, dim=names.index(shard))[rank].reshape(-1, 2)
            try:  # no collective inside (a partial split)
                got = split_rows(where, cond.reshape(-1, 2), rows, grid, shard, None)
            except (IndexError, RuntimeError, ValueError) as exc:
                wrong.append(f"{where}: split_rows of the conditioning '{rows_text}' raised {exc}")
                continue
            if not torch.equal(got, want):
                wrong.append(f"{where}: split_rows of the conditioning '{rows_text}' gave rows "
                             f"{got[:, 0].tolist()}, expected {want[:, 0].tolist()}")
    return wrong


def _starts(lay: Layout) -> list[tuple[int, tuple[str, ...]]]:
    out, i = [], 0
    for names in lay.dims:
        out.append((i, names))
        i += len(names)
    return out


def _fold(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    return x.reshape([math.prod(x.shape[i:i + len(names)]) for i, names in _starts(lay)])


@pytest.mark.parametrize("n", [2, 4])
def test_plan_split_gather_and_rows_bit_exact(n: int) -> None:
    wrong = [line for lines in run_distributed(_cases, n) for line in lines]
    assert not wrong, "\n".join(wrong)
