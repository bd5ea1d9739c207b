"""``Sharded`` is not video-specific: a 3-axis (T x H x W) toy model, uneven lengths, 2 and 4 ranks.

Oracle: the same blocks applied in plain torch on the full tensor (``movedim`` +
``reshape``, no Sharded, no collectives). Each block attends along one axis;
the adapter-style forward uses only enter / attend / fold / unfold / leave.
"""

from __future__ import annotations

import pytest
import torch

from dsp_plugin import reduce_gradients
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.adapters import Sharded
from dsp_plugin.checks import check_mode
from dsp_plugin.plan.schedule import switch_schedule
from tests.distributed import assert_no_steady_state_checks, run_distributed

SHAPE, D = (2, 5, 6, 7), 8          # B, T, H, W (uneven on 2 and 4 ranks), channels
ORDER = [1, 2, 3, 1, 2, 3]         # the axis each block attends


class Mixer(torch.nn.Module):
    """Softmax attention along the middle dim of [rows, L, D] (single-head, no mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + torch.softmax(q @ k.transpose(1, 2) / D**0.5, dim=-1) @ v


def _model() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Mixer() for _ in ORDER)


def _reference(blocks: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block, d in zip(blocks, ORDER):
        moved = x.movedim(d, -2)
        x = block(moved.reshape(-1, *moved.shape[-2:])).reshape(moved.shape).movedim(-2, d)
    return x


def _adapted(blocks: torch.nn.ModuleList, x: torch.Tensor, *, belady: bool) -> torch.Tensor:
    # belady: the switch targets of the STDiT plan's schedule (furthest next use), 3 switches instead of 6
    schedule = switch_schedule(ORDER, (1, 2, 3), first_shard=1)[0] if belady else [None] * len(ORDER)
    seq = Sharded.enter(x, shard=1)
    for block, d, switch in zip(blocks, ORDER, schedule):
        seq = seq.attend(d, then=switch[1] if switch else None)
        seq = seq.unfold(block(seq.fold(d)), d)
    return seq.leave()


def _compare(rank: int, n: int, belady: bool = False) -> dict[str, float]:
    x = torch.randn(*SHAPE, D, generator=torch.Generator().manual_seed(1))
    ref_blocks, blocks = _model(), _model()
    xr, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = _reference(ref_blocks, xr)
    expected.square().mean().backward()
    with CommAccounting(activations=False) as acct:
        out = _adapted(blocks, xa, belady=belady)
        out.square().mean().backward()
    reduce_gradients(blocks.parameters())
    grads = max((a.grad - b.grad).abs().max().item() for a, b in zip(blocks.parameters(), ref_blocks.parameters()))
    with CommAccounting(activations=False) as steady:      # the same step again: nothing is new
        _adapted(blocks, x.clone().requires_grad_(True), belady=belady).square().mean().backward()
    return {"out": (out - expected).abs().max().item(), "dx": (xa.grad - xr.grad).abs().max().item(),
            "grads": grads, "switches": acct.count("all_to_all", "forward"),
            "steady_checks": [(r.op, r.group_ranks) for r in steady.check_records], "check_mode": check_mode()}


def test_single_process() -> None:
    d = _compare(0, 1)
    assert max(d["out"], d["dx"], d["grads"]) < 1e-5, d


@pytest.mark.parametrize("n", [2, 4])
def test_three_axes_uneven(n: int) -> None:
    for belady, switches in ((False, 6), (True, 3)):
        for rank, d in enumerate(run_distributed(_compare, n, belady)):
            assert max(d["out"], d["dx"], d["grads"]) < 1e-5, (rank, d)
            # default target: the next axis, so every block switches; furthest-next-use: every other block
            assert d["switches"] == switches, (belady, d)
            assert_no_steady_state_checks(d["steady_checks"], d["check_mode"], f"Sharded, rank {rank}/{n}")


def test_fold_on_the_sharded_dim_is_an_error() -> None:
    seq = Sharded.enter(torch.zeros(1, 4, 4, 2), shard=1)
    with pytest.raises(ValueError, match=r"dim 1 is sharded; call attend\(1\) first"):
        seq.fold(1)
    with pytest.raises(ValueError, match=r"dim 3 is not a sequence dim \(1, 2\)"):
        seq.attend(3)
    with pytest.raises(ValueError, match=r"dim 2 holds 3, expected 4"):
        Sharded.wrap(torch.zeros(1, 4, 3, 2), lengths=(4, 4), shard=1)
