"""``--load``: a torch_dist checkpoint's files checked against its own ``.metadata`` before any collective.

Megatron's ``torch_dist`` format is PyTorch Distributed Checkpoint: ``iter_NNNNNNN/.metadata`` (pickled
``Metadata``: for every stored item, the ``.distcp`` file, byte offset and length that hold it) and one
``__<rank>_<n>.distcp`` per writer. A file cut short (a full disk, an interrupted copy) loaded after the model
is built, about a minute into the launch, as a bare ``EOFError: Ran out of input`` that names no file.
``check_distcp_files`` reads only ``.metadata`` and the files' sizes, so every rank refuses alike, at once,
naming each file, its size and the size the metadata expects. Used by ``resume.check_load_path``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["checkpoint_folder", "check_distcp_files"]


def checkpoint_folder(load: str, step: int | None) -> Path | None:
    """The folder Megatron's ``load_checkpoint`` reads: ``iter_{step:07d}`` for ``--ckpt-step``, else the tracker's
    iteration (or ``release``); None when the tracker cannot be read (Megatron reports that itself)."""
    if step:
        return Path(load) / f"iter_{step:07d}"
    try:
        text = (Path(load) / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return None
    if text == "release":
        return Path(load) / "release"
    return Path(load) / f"iter_{int(text):07d}" if text.isdigit() else None


def check_distcp_files(folder: str | os.PathLike) -> None:
    """Refuse (``ValueError`` naming each file) a torch_dist checkpoint folder whose ``.distcp`` files are missing
    or shorter than its ``.metadata`` says, or whose ``.metadata`` cannot be read. Another format: nothing to do."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        return  # not torch_dist (Megatron's legacy per-rank torch files), or no checkpoint there
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated pickle raises EOFError, UnpicklingError, ...
        raise ValueError(f"--load: {folder / '.metadata'} cannot be read ({type(exc).__name__}: {exc or 'empty'}; "
                         f"{(folder / '.metadata').stat().st_size} bytes): the checkpoint is damaged or its copy "
                         f"incomplete; expected a folder written whole by --save (copy it again, or load another "
                         f"iteration with --ckpt-step)") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    damaged = []
    for name, size in sorted(needed.items()):
        path = folder / name
        have = path.stat().st_size if path.is_file() else None
        if have is None or have < size:
            damaged.append(f"{path} {'is missing' if have is None else f'has {have} bytes'}, its .metadata "
                           f"expects {size}")
    if damaged:
        raise ValueError(f"--load: the checkpoint in {folder} is incomplete: {'; '.join(damaged)} (a truncated "
                         f"copy or an interrupted save); expected every file whole as --save wrote it (copy it "
                         f"again, or load another iteration with --ckpt-step)")
