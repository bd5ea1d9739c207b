"""``--load`` of a torch_dist checkpoint with a truncated ``.distcp`` (or ``.metadata``) is refused naming the file,
before any collective (issue 52, unclear 14: Megatron's loader raised a bare ``EOFError: Ran out of input`` after
building the model, ~90 s into a 2-rank CPU launch, naming no file).

The checkpoint is written by PyTorch Distributed Checkpoint itself (``torch.distributed.checkpoint.save``, the
writer behind Megatron's torch_dist format: ``.metadata`` plus ``__<rank>_<n>.distcp``) in this process, laid out
as Megatron's ``--save`` lays it out (``iter_0000002``, ``latest_checkpointed_iteration.txt``); the intact one
loads back with PyTorch's own reader, so the check refuses only what cannot be read.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch


def _saved(tmp: Path) -> Path:
    from torch.distributed.checkpoint import save

    g = torch.Generator().manual_seed(0)
    state = {"decoder.weight": torch.randn(64, 32, generator=g), "decoder.bias": torch.randn(64, generator=g)}
    save(state, checkpoint_id=str(tmp / "iter_0000002"), no_dist=True)
    (tmp / "latest_checkpointed_iteration.txt").write_text("2")
    return tmp


def _check(load: Path, step: int | None = None) -> str | None:
    from dsp_plugin.megatron.resume import check_load_path

    return check_load_path(argparse.Namespace(load=str(load), ckpt_step=step, save=None))


def test_an_intact_checkpoint_passes_and_reads_back(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load

    ckpt = _saved(tmp_path)
    assert _check(ckpt) is None and _check(ckpt, 2) is None
    back = {"decoder.weight": torch.empty(64, 32), "decoder.bias": torch.empty(64)}
    load(back, storage_reader=FileSystemReader(str(ckpt / "iter_0000002")), no_dist=True)
    assert back["decoder.weight"].abs().sum() > 0


@pytest.mark.parametrize("step", [None, 2])     # the tracker's iteration, --ckpt-step
def test_a_truncated_distcp_is_named(tmp_path: Path, step: int | None) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = _saved(tmp_path)
    distcp = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    full = distcp.stat().st_size
    os.truncate(distcp, full // 2)
    back = {"decoder.weight": torch.empty(64, 32), "decoder.bias": torch.empty(64)}
    with pytest.raises(CheckpointException):  # what PyTorch's own reader does with it
        load(back, storage_reader=FileSystemReader(str(ckpt / "iter_0000002")), no_dist=True)
    with pytest.raises(ValueError) as info:
        _check(ckpt, step)
    assert (f"--load: the checkpoint in {ckpt / 'iter_0000002'} is incomplete: {distcp} has {full // 2} bytes, its "
            f".metadata expects {full}") in str(info.value), info.value
    distcp.unlink()
    with pytest.raises(ValueError, match=f"{distcp} is missing, its .metadata expects {full}"):
        _check(ckpt, step)


def test_a_truncated_metadata_is_named(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    metadata = ckpt / "iter_0000002" / ".metadata"
    os.truncate(metadata, metadata.stat().st_size // 3)
    with pytest.raises(ValueError, match=r"--load: .*iter_0000002/\.metadata cannot be read \((EOF|Unpickling)Error"):
        _check(ckpt)
