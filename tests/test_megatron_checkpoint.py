"""Megatron's own ``--save/--load`` (torch_dist, through the model's ``sharded_state_dict``) at
TP=2 x DSP=2 and PP=2 x DSP=2: a resumed run equals the uninterrupted run bit for bit, for every
iteration after the resume.

Each layout, two launches: the uninterrupted run (6 iterations) saves at iteration 2 (and 4, 6); the
second run loads iteration 2 (RNG states included, no ``--no-load-rng``) **with full recompute**
(``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``) and runs
iterations 3-6. Both train with what a resume must carry: Megatron's Adam (its moments), a
learning rate that changes every iteration (warm-up, then cosine decay), the data position (consumed
samples) and hidden and attention dropout (masks from the CPU generator the checkpoint restores).
Iterations 3-6 are compared on TensorBoard's float32 ``loss`` scalars (each iteration's own loss)
and on Megatron's log lines: iteration 6's loss shows the third optimizer step after the resume.
This also checks the checkpoint's TP shards and pipeline layer offsets, and that recompute (which
replays the dropout masks) leaves the losses unchanged. The DSP=1, DSP=2 and DSP=2 -> DSP=4 resumes
are in ``test_megatron_launch.py`` (they share its 20-iteration runs).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

from tests.megatron_launch import DROPOUT, RECOMPUTE, SCHEDULE, launch, tensorboard_losses  # noqa: E402

pytestmark = pytest.mark.slow

ITERS, SAVED = 6, 2


@pytest.mark.parametrize("layout", [{"TP": "2", "DSP": "2"}, {"PP": "2", "DSP": "2"}], ids=["TP2xDSP2", "PP2xDSP2"])
def test_resume_is_bit_exact_with_and_without_recompute(layout: dict[str, str], tmp_path) -> None:
    ckpt, boards = str(tmp_path / "ckpt"), [tmp_path / "tb_uninterrupted", tmp_path / "tb_resumed"]
    uninterrupted, _ = launch("--save", ckpt, "--save-interval", str(SAVED), "--tensorboard-dir", str(boards[0]),
                              *SCHEDULE, *DROPOUT, iters=ITERS, NPROC="4", **layout)
    resumed, out = launch("--load", ckpt, "--ckpt-step", str(SAVED), "--tensorboard-dir", str(boards[1]),
                          *SCHEDULE, *DROPOUT, *RECOMPUTE, iters=ITERS, NPROC="4", **layout)
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    exact = [tensorboard_losses(board) for board in boards]
    after = list(range(SAVED + 1, ITERS + 1))
    print(f"\n{layout}: uninterrupted {uninterrupted}, resumed with full recompute {resumed}; "
          f"TensorBoard: {exact}")
    assert sorted(uninterrupted) == list(range(1, ITERS + 1)) and sorted(resumed) == after
    assert sorted(exact[1]) == after, exact
    for i in after:
        assert exact[1][i] == exact[0][i], f"iteration {i}: resumed {exact[1][i]!r}, uninterrupted {exact[0][i]!r}"
        assert resumed[i] == uninterrupted[i], f"iteration {i}'s log line: resumed {resumed[i]}, " \
                                               f"uninterrupted {uninterrupted[i]}"
