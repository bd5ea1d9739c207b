"""The ``dsp_plugin`` logger: what our launches say, on rank 0 only unless a record asks for every rank.

    from dsp_plugin.log import get_logger
    log = get_logger(__name__)          # a child of "dsp_plugin"
    log.info("wrote %s", path)          # printed by rank 0
    log.warning("rank-local", extra={"all_ranks": True})   # printed by every rank, prefixed with its rank

``setup()`` (called by the launches) gives the ``dsp_plugin`` logger one handler, to stderr or stdout (the
training launches' tables), with the rank-0 filter; a user's own logging configuration is left alone
otherwise (``setup`` adds nothing twice).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["RankZeroFilter", "get_logger", "quiet_third_party", "setup"]

#: the libraries whose deprecation notices and info logs would land inside our tables and logs
THIRD_PARTY = ("torch", "deepspeed", "DeepSpeed", "diffusers", "transformers", "megatron", "accelerate")


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Lets records through on rank 0; on other ranks only those logged with ``extra={"all_ranks": True}``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank_prefix = f"[rank {rank}] " if getattr(record, "all_ranks", False) else ""
        return rank == 0 or getattr(record, "all_ranks", False)


def get_logger(name: str = "dsp_plugin") -> logging.Logger:
    return logging.getLogger(name if name.startswith("dsp_plugin") else f"dsp_plugin.{name}")


class _StandardStream(logging.StreamHandler):
    """A handler writing to whatever ``sys.stdout`` / ``sys.stderr`` is when a record comes (pytest's capture,
    a redirect made after ``setup``), not the stream of the moment it was made."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return getattr(sys, self.which)

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def setup(level: int = logging.INFO, stream: str = "stderr") -> logging.Logger:
    """One handler on the ``dsp_plugin`` logger, to ``sys.stderr`` (or ``"stdout"``: the launches' tables),
    with the rank-0 filter. A second call adds no handler; it sets the level and the stream."""
    logger = logging.getLogger("dsp_plugin")
    handler = next((h for h in logger.handlers if isinstance(h, _StandardStream)), None)
    if handler is None:
        handler = _StandardStream(stream)
        handler.addFilter(RankZeroFilter())
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    handler.which = stream
    logger.setLevel(level)
    return logger


def quiet_third_party() -> None:
    """Keep third-party deprecation warnings and info logs out of our output (the benches' tables, the
    launches' logs): FutureWarning, DeprecationWarning and UserWarning raised from their modules are ignored,
    their loggers show errors only. Our own warnings, and theirs of other categories, still show."""
    import warnings

    pattern = "|".join(THIRD_PARTY)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=rf"({pattern})(\.|$)")
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.ERROR)
