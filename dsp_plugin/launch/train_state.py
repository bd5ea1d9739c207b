"""dsp-train's checkpoints: what a resumed run needs to equal the uninterrupted one (issue 48).

    save(save_dir, step, model=..., optimizer=..., scheduler=..., loader=...)    # every rank
    step = load(load_dir, model=..., optimizer=..., scheduler=..., loader=...)   # every rank; next: step + 1

The parameters are replicated over DSP and DP (``reduce_gradients`` gives every rank the same gradient), so
rank 0 writes the training state once (``state.pt``: the model, the optimizer's state (Adam's moments), the
schedule's step, the loader's position and the step); every rank writes its own RNG states
(``rng_rank{r}.pt``, ``dsp_plugin.rng``). ``save_dir/step{N}`` is complete before ``latest`` names it: rank 0
renames ``latest`` into place after every rank has written, so an interrupted save never becomes ``latest``.
Everything loads with ``weights_only=True``; ``check_load_dir`` reads only files, so every rank refuses a bad
``--load-dir`` alike, before any collective.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import rng

__all__ = ["check_load_dir", "load", "save"]

_LATEST, _STATE, _RNG = "latest", "state.pt", "rng_rank{}.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _meet() -> None:
    """Every rank has written its files (a sum over the world; nothing to do on one process)."""
    if dist.is_initialized():
        from dsp_plugin.comm.collectives import all_reduce_sum

        all_reduce_sum(torch.zeros(1), group=None)


def _atomic(write: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    write(tmp)
    os.replace(tmp, path)


def save(save_dir: str | os.PathLike[str], step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, loader: Any, device: torch.device | None = None) -> Path:
    """Write ``save_dir/step{step}`` and point ``latest`` at it; returns the checkpoint's path."""
    target = Path(save_dir) / f"step{step}"
    target.mkdir(parents=True, exist_ok=True)
    rank = _rank()
    _atomic(lambda tmp: torch.save(rng.states(device), tmp), target / _RNG.format(rank))
    if rank == 0:
        state = {"step": step, "world": dist.get_world_size() if dist.is_initialized() else 1,
                 "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "loader": loader.state_dict()}
        _atomic(lambda tmp: torch.save(state, tmp), target / _STATE)
    _meet()
    if rank == 0:
        _atomic(lambda tmp: Path(tmp).write_text(target.name + "\n"), Path(save_dir) / _LATEST)
    return target


def check_load_dir(load_dir: str | os.PathLike[str]) -> Path:
    """The checkpoint ``load_dir/latest`` names, with its state: a ``ValueError`` naming what is missing."""
    path = Path(load_dir)
    latest = path / _LATEST
    if not latest.is_file():
        what = "does not exist" if not path.exists() else f"has no '{_LATEST}' file"
        raise ValueError(f"--load-dir {str(path)!r} {what}; expected a directory written by --save-dir "
                         f"(its '{_LATEST}' names the checkpoint)")
    checkpoint = path / latest.read_text().strip()
    if not (checkpoint / _STATE).is_file():
        raise ValueError(f"--load-dir {str(path)!r}: '{_LATEST}' names {checkpoint.name!r}, which has no "
                         f"{_STATE}; expected a complete checkpoint written by --save-dir")
    return checkpoint


def load(load_dir: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, loader: Any, device: torch.device | None = None) -> int:
    """Load the latest checkpoint into the four objects (in place) and this rank's RNG states; the saved step.

    The RNG states come from the same rank's file when the world size is the saving one; at another world
    size no rank's draws map onto another's, and they are not restored (rank 0 says so)."""
    checkpoint = check_load_dir(load_dir)
    state = torch.load(checkpoint / _STATE, map_location=device or "cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = checkpoint / _RNG.format(_rank())
    if state["world"] == world and rng_file.is_file():
        rng.restore(torch.load(rng_file, map_location="cpu", weights_only=True), device)
    else:
        from dsp_plugin.log import get_logger

        get_logger(__name__).warning("%s: RNG states not restored (saved by %d processes, this run has %d): the "
                                     "random draws after the resume are not the uninterrupted run's",
                                     checkpoint, state["world"], world)
    return int(state["step"])
