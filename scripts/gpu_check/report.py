"""The result convention of the GPU checks: one ``figure:`` line, exit 0 (PASS), 1 (FAIL) or 77 (SKIP).

``scripts/gpu_check.sh`` prints each step as ``PASS|FAIL|SKIP  name  figure`` from these.
"""

from __future__ import annotations

import socket
import sys
from typing import NoReturn

SKIP = 77


def finish(ok: bool, figure: str) -> NoReturn:
    print(f"figure: {figure}", flush=True)
    sys.exit(0 if ok else 1)


def skip(reason: str) -> NoReturn:
    print(f"figure: {reason}", flush=True)
    sys.exit(SKIP)


def free_port() -> str:
    """A free TCP port for a launch's MASTER_PORT (steps may run side by side on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
