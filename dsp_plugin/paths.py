"""Output paths checked before the work, so a run never computes for minutes and then cannot write.

``check_output_file("--out", path)`` and ``check_output_dir("--save", path)`` create the missing
directories and prove them writable with a temporary file, raising ``OutputPathError`` naming the
flag, the path and the reason. A launch calls them before its first collective: on every rank
where every rank writes (Megatron's ``--save``), on the writing rank where only rank 0 writes
(``sample_latte --out``), whose verdict ``raise_on_every_rank`` then hands to every rank.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["OutputPathError", "check_output_dir", "check_output_file", "raise_on_every_rank"]


class OutputPathError(ValueError):
    """An output path cannot be written; raised before the work, naming the flag and the path."""


def check_output_dir(flag: str, path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) if needed and write a temporary file in it."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise OutputPathError(f"{flag} {str(directory)!r} is a file; expected a directory (it is checked before "
                              f"the run, so no step is lost)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dsp_write_test"):
            pass
    except OSError as exc:
        reason = exc.strerror or exc
        raise OutputPathError(f"{flag} {str(directory)!r} cannot be written ({type(exc).__name__}: {reason}); "
                              f"expected a directory this user can create and write (checked before the run, "
                              f"so no step is lost)") from None
    return directory


def check_output_file(flag: str, path: str | os.PathLike) -> Path:
    """``path``'s directory can be written (created if missing) and ``path`` is not a directory."""
    target = Path(path)
    if target.is_dir():
        raise OutputPathError(f"{flag} {str(target)!r} is a directory; expected a file name to write")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{flag} {str(target)!r} exists and cannot be overwritten (no write permission); "
                              f"checked before the run, so nothing is computed for nothing")
    check_output_dir(flag, target.parent if str(target.parent) else ".")
    return target


def raise_on_every_rank(name: str, error: Exception | None) -> None:
    """Raise ``error`` (one rank's, e.g. rank 0's path check) on every rank of the world: one small all_gather.

    Without torch.distributed (one process) it raises ``error`` itself.
    """
    import torch.distributed as dist

    from dsp_plugin.comm import raise_together

    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    raise_together(name, error, group=dist.group.WORLD)
