"""Megatron's own ``--save/--load`` (torch_dist, through the model's ``sharded_state_dict``) at
TP=2 x DSP=2 and PP=2 x DSP=2: resuming gives the uninterrupted loss bit-exactly.

Each layout: a run saves at iteration 2 and goes on to 3; a second run loads
iteration 2 (RNG state included, no ``--no-load-rng``) **with full recompute**
(``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``)
and must log the same iteration-3 loss: this checks the checkpoint (TP shards and
pipeline layer offsets) and that recompute leaves the losses unchanged.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from tests.megatron_launch import RECOMPUTE, launch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [{"TP": "2", "DSP": "2"}, {"PP": "2", "DSP": "2"}], ids=["TP2xDSP2", "PP2xDSP2"])
def test_resume_is_bit_exact_with_and_without_recompute(layout: dict[str, str], tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    uninterrupted, _ = launch("--save", ckpt, "--save-interval", "2", NPROC="4", **layout)
    resumed, out = launch("--load", ckpt, "--ckpt-step", "2", *RECOMPUTE, NPROC="4", **layout)
    assert "successfully loaded checkpoint" in out and "Unable to load rng state" not in out
    print(f"\n{layout}: uninterrupted {uninterrupted}, resumed with full recompute {resumed}")
    assert sorted(uninterrupted) == [1, 2, 3] and sorted(resumed) == [3]
    assert resumed[3] == uninterrupted[3]
