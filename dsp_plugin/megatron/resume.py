"""``--load`` of a directory without a checkpoint: refused unless it is the ``--save`` directory (auto-resume).

Megatron treats a missing directory or tracker file as "no checkpoint" and trains
from scratch with exit status 0, so a mistyped ``--load`` looks like a resume.
Megatron's auto-resume idiom passes the same ``--save D --load D`` on every run of
a job, the first included, and that first run must start from scratch as in
``megatron.training``. Used by ``dsp_plugin/launch/pretrain_stdit.py``.
"""

from __future__ import annotations

import argparse
import os

from dsp_plugin.megatron.checkpoint_files import check_distcp_files, checkpoint_folder

__all__ = ["add_load_arguments", "check_load_path"]


def add_load_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--allow-fresh-start``: let ``--load DIR`` start from scratch when DIR holds no checkpoint."""
    parser.add_argument("--allow-fresh-start", action="store_true",
                        help="with --load: start from scratch when the directory holds no checkpoint "
                             "(default: refuse unless it is the --save directory, since Megatron would "
                             "silently train from scratch)")
    return parser


def check_load_path(args: argparse.Namespace) -> str | None:
    """Refuse ``--load DIR`` when DIR holds no Megatron checkpoint and is not the ``--save`` directory.

    Megatron treats a missing directory or tracker file as "no checkpoint" and
    trains from scratch with exit status 0; a mistyped path then looks like a
    resume. Megatron's auto-resume idiom passes the same ``--save D --load D`` on
    every run of a job, the first included: with ``--load`` naming the ``--save``
    directory (or with ``--allow-fresh-start``) an empty directory starts from
    scratch, as in ``megatron.training``, and the returned line says so for the log.
    ``--ckpt-step N`` (Megatron then loads ``iter_{N:07d}``, not the tracker's
    iteration) is refused when that folder is missing, whatever the tracker says.
    Returns None when there is a checkpoint to load (or no ``--load``). Reads only
    files, so it raises alike on every rank before any collective.
    """
    load = getattr(args, "load", None)
    if not load:
        return None
    step = getattr(args, "ckpt_step", None)
    if step:  # Megatron loads iter_{step:07d} instead of the tracker's iteration (a step of 0: the tracker's)
        folder = os.path.join(load, f"iter_{step:07d}")
        if os.path.isdir(folder):
            check_distcp_files(folder)  # a .distcp file cut short: named now, not an EOFError after the build
            return None
        held = sorted(n for n in os.listdir(load) if n.startswith("iter_")) if os.path.isdir(load) else []
        raise ValueError(f"--ckpt-step {step}: {folder!r} does not exist (--load holds "
                         f"{', '.join(held[-5:]) if held else 'no iter_* folder'}); Megatron would stop with "
                         "FileNotFoundError after building the model. Expected the step of a checkpoint in --load, "
                         "or no --ckpt-step (the tracker's latest)")
    if os.path.isfile(os.path.join(load, "latest_checkpointed_iteration.txt")):
        folder = checkpoint_folder(load, None)
        if folder is not None:
            check_distcp_files(folder)
        return None
    save = getattr(args, "save", None)
    if save and os.path.realpath(save) == os.path.realpath(load):
        return (f"--load {load!r} is the --save directory and holds no checkpoint yet: starting from scratch "
                "(Megatron's auto-resume; the next run of the same command resumes from what this one saves)")
    if getattr(args, "allow_fresh_start", False):
        return f"--load {load!r} holds no checkpoint: starting from scratch (--allow-fresh-start)"
    what = "does not exist" if not os.path.exists(load) else "holds no Megatron checkpoint (no " \
        "latest_checkpointed_iteration.txt)"
    raise ValueError(f"--load {load!r} {what} and is not the --save directory ({save!r}); Megatron would train "
                     "from scratch. Expected a directory written by --save (or --save D --load D, Megatron's "
                     "auto-resume); pass --allow-fresh-start to start from scratch when it is empty")
