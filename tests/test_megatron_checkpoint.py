"""Megatron's own ``--save/--load`` (torch_dist, through the model's ``sharded_state_dict``) at
TP=2 x DSP=2 and PP=2 x DSP=2: resuming gives the uninterrupted loss bit-exactly.

Each layout: a run saves at iteration 2 and goes on to 3; a second run loads
iteration 2 (RNG state included, no ``--no-load-rng``) **with full recompute**
(``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``)
and must log the same iteration-3 loss: this checks the checkpoint (TP shards and
pipeline layer offsets) and that recompute leaves the losses unchanged. The comparison
is on TensorBoard's float32 ``loss`` scalars (bit-exact) when tensorboard is installed,
on Megatron's 7-digit log line otherwise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from tests.megatron_launch import RECOMPUTE, launch, tensorboard_losses  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [{"TP": "2", "DSP": "2"}, {"PP": "2", "DSP": "2"}], ids=["TP2xDSP2", "PP2xDSP2"])
def test_resume_is_bit_exact_with_and_without_recompute(layout: dict[str, str], tmp_path) -> None:
    ckpt, boards = str(tmp_path / "ckpt"), [tmp_path / "tb_uninterrupted", tmp_path / "tb_resumed"]
    uninterrupted, _ = launch("--save", ckpt, "--save-interval", "2", "--tensorboard-dir", str(boards[0]),
                              NPROC="4", **layout)
    resumed, out = launch("--load", ckpt, "--ckpt-step", "2", "--tensorboard-dir", str(boards[1]), *RECOMPUTE,
                          NPROC="4", **layout)
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    exact = [tensorboard_losses(board) for board in boards]
    print(f"\n{layout}: uninterrupted {uninterrupted}, resumed with full recompute {resumed}; "
          f"TensorBoard: {exact}")
    assert sorted(uninterrupted) == [1, 2, 3] and sorted(resumed) == [3]
    assert resumed[3] == uninterrupted[3]
    if exact[0] is not None:
        assert sorted(exact[1]) == [3] and exact[1][3] == exact[0][3]
