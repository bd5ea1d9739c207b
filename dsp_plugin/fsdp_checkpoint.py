"""``torch.distributed.checkpoint`` (DCP) saves of an FSDP2 model, its optimizer and the data position.

    fsdp_checkpoint.save(save_dir, model, optimizer, step=step, loader=loader)   # every rank
    step = fsdp_checkpoint.load(load_dir, model, optimizer, loader=loader)      # every rank; the next step: step + 1
    step = fsdp_checkpoint.load(f"{save_dir}/step2", model, optimizer, loader=loader)   # an earlier one

Each rank writes its own shards (DCP, ``get_state_dict``'s sharded model and optimizer state) into
``save_dir/step{N}``; the step and the loader's position (``dsp_dataloader.state_dict()``, all ints) travel in
the same checkpoint as int64 tensors, so nothing is unpickled at load. DCP's coordinator (rank 0) writes the
checkpoint's ``.metadata`` only after every rank has written, and rank 0 then writes ``save_dir/latest``
(atomically, a rename), so an interrupted save never becomes ``latest``. A checkpoint loads into another
DP x DSP layout too (DCP reshards), and the loader resumes at the same sample if the global batch divides it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_load_dir", "check_save_dir", "load", "save"]

_LATEST = "latest"


def check_save_dir(save_dir: str | os.PathLike[str]) -> Path:
    """``save_dir`` can be made and written: a clear error at once, on every rank, before any collective."""
    path = Path(save_dir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"save_dir {str(path)!r} is a file; expected a directory for the checkpoints")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"save_dir {str(path)!r} cannot be created ({exc.strerror}); expected a writable path") from exc
    if not os.access(path, os.W_OK):
        raise PermissionError(f"save_dir {str(path)!r} is not writable; expected a directory this user can write")
    return path


def check_load_dir(load_dir: str | os.PathLike[str]) -> Path:
    """The checkpoint ``load_dir/latest`` names, or ``load_dir`` itself if it is one (``save_dir/step{N}``), complete
    (its ``.metadata`` written): a clear error otherwise."""
    path = Path(load_dir)
    if (path / ".metadata").is_file():
        return path
    latest = path / _LATEST
    if not latest.is_file():
        what = "does not exist" if not path.exists() else f"has no '{_LATEST}' file"
        raise FileNotFoundError(f"load_dir {str(path)!r} {what}; expected a directory written by "
                                f"dsp_plugin.fsdp_checkpoint.save (its '{_LATEST}' names the checkpoint), or one "
                                f"of its checkpoints (save_dir/step<N>)")
    checkpoint = path / latest.read_text().strip()
    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"load_dir {str(path)!r}: '{_LATEST}' names {checkpoint.name!r}, which has no DCP "
                                f".metadata; expected a complete checkpoint (was a save interrupted, or a file moved?)")
    return checkpoint


def save(save_dir: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
         loader: Any = None) -> Path:
    """Write ``model``'s and ``optimizer``'s sharded state, ``step`` and ``loader.state_dict()`` (if given) to
    ``save_dir/step{step}``, then point ``latest`` at it. Every rank calls it. Returns the checkpoint's path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = check_save_dir(save_dir)
    target = root / f"step{step}"
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": _progress(step, loader)}
    dcp.save(state, checkpoint_id=target)
    if dist.get_rank() == 0:  # the coordinator: every rank's files and the .metadata are written by now
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{_LATEST}.")
        with os.fdopen(fd, "w") as f:
            f.write(target.name + "\n")
        os.replace(tmp, root / _LATEST)
    return target


def load(load_dir: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, *,
         loader: Any = None) -> int:
    """Load ``load_dir``'s latest checkpoint (or ``load_dir`` itself, a checkpoint) into ``model``, ``optimizer`` and
    ``loader`` (in place); return the step it was saved at. Every rank calls it, after ``fully_shard`` and before
    the first step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    checkpoint = check_load_dir(load_dir)
    model_state, optim_state = get_state_dict(model, optimizer)
    progress = _progress(0, loader)
    state = {"model": model_state, "optim": optim_state, "progress": progress}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    progress = state["progress"]
    if loader is not None:
        loader.load_state_dict({k: int(v) for k, v in progress["loader"].items()})
    return int(progress["step"])


def _progress(step: int, loader: Any) -> dict[str, Any]:
    """The step and the loader's position as int64 tensors (DCP stores them as tensors: no pickle at load)."""
    out: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.int64)}
    if loader is not None:
        out["loader"] = {k: torch.tensor(int(v), dtype=torch.int64) for k, v in loader.state_dict().items()}
    return out
