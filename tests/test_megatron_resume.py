"""``check_load_path`` with ``--ckpt-step``: the folder it looks for is the one Megatron writes and loads.

Megatron loads ``--ckpt-step N`` from the folder its own ``get_checkpoint_name`` names (``iter_%07d``), not the
tracker's iteration. The oracle is that function: a folder it names is accepted with or without a tracker file;
a step whose folder is missing is refused, naming the folder, whether the directory holds another step, a folder
of a near name (6 digits), a tracker, nothing, or is the ``--save`` directory (Megatron would fail to load it
after building the model, not start from scratch); a step of 0 is Megatron's "the tracker's" (its check is
``if args.ckpt_step``). No ``--ckpt-step`` is ``tests/test_reliability_launch.py``'s.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace
from pathlib import Path

import pytest

from dsp_plugin.megatron.resume import check_load_path

checkpointing = pytest.importorskip("megatron.training.checkpointing")


def _args(load: Path, step: int | None, save: Path | None = None, allow: bool = False) -> Namespace:
    return Namespace(load=str(load), save=None if save is None else str(save), allow_fresh_start=allow,
                     ckpt_step=step)


def _megatron_folder(load: Path, step: int) -> Path:
    """The folder Megatron saves step ``step`` in and loads ``--ckpt-step step`` from."""
    folder = Path(checkpointing.get_checkpoint_name(str(load), step, return_base_dir=True))
    folder.mkdir(parents=True)
    return folder


@pytest.mark.parametrize("step", [7, 100, 12345678])  # 8 digits: wider than the padding
@pytest.mark.parametrize("tracker", [False, True])
def test_a_step_megatron_saved_is_accepted(tmp_path: Path, step: int, tracker: bool) -> None:
    folder = _megatron_folder(tmp_path, step)
    _megatron_folder(tmp_path, step + 1)  # a later step besides
    if tracker:
        Path(checkpointing.get_checkpoint_tracker_filename(str(tmp_path))).write_text(str(step + 1))
    assert check_load_path(_args(tmp_path, step)) is None, (folder, sorted(os.listdir(tmp_path)))


@pytest.mark.parametrize("held", ["another step", "a 6-digit name", "the tracker", "nothing", "the save directory",
                                  "allow fresh start"])
def test_a_step_megatron_did_not_save_is_refused_naming_its_folder(tmp_path: Path, held: str) -> None:
    save, allow = None, False
    if held == "another step":
        _megatron_folder(tmp_path, 200)
    elif held == "a 6-digit name":
        (tmp_path / "iter_000100").mkdir()
    elif held == "the tracker":
        _megatron_folder(tmp_path, 200)
        Path(checkpointing.get_checkpoint_tracker_filename(str(tmp_path))).write_text("200")
    elif held == "the save directory":  # auto-resume: a fresh start, but not with a step to load
        save = tmp_path
    elif held == "allow fresh start":
        allow = True
    expected = checkpointing.get_checkpoint_name(str(tmp_path), 100, return_base_dir=True)
    with pytest.raises(ValueError, match=re.escape(f"--ckpt-step 100: '{expected}' does not exist")) as info:
        check_load_path(_args(tmp_path, 100, save, allow))
    if held == "another step":
        assert "--load holds iter_0000200" in str(info.value), info.value


def test_a_step_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--ckpt-step 100: .*nowhere/iter_0000100' does not exist \(--load holds "
                                         r"no iter_\* folder\)"):
        check_load_path(_args(tmp_path / "nowhere", 100))


def test_step_zero_is_the_trackers(tmp_path: Path) -> None:
    """``--ckpt-step 0``: Megatron reads the tracker (``if args.ckpt_step``), so an ``iter_0000000`` folder alone
    is no checkpoint to it."""
    _megatron_folder(tmp_path, 0)
    with pytest.raises(ValueError, match="holds no Megatron checkpoint"):
        check_load_path(_args(tmp_path, 0))
    Path(checkpointing.get_checkpoint_tracker_filename(str(tmp_path))).write_text("0")
    assert check_load_path(_args(tmp_path, 0)) is None
