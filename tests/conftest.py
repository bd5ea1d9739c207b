"""Shared pytest fixtures. megatron-core is imported inside the fixture that needs it, so other tests never load it."""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

# The suite's multi-process tests are CPU (gloo) tests by design, on a GPU machine too: DSP_BACKEND=gloo keeps
# dsp_plugin.backend on gloo and the CPU for what the tests start (make train, the sampling launches, the benches'
# spawn(backend="auto")); spawned processes inherit it. The GPU checks are `pytest -m gpu` and scripts/gpu_check.sh.
os.environ.setdefault("DSP_BACKEND", "gloo")


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A 1-rank gloo world with Megatron's parallel_state initialised; torn down whatever happens."""
    from megatron.core import parallel_state as ps

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                             rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False)
            yield
        finally:
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How often each rank pool started and what made it rebuild (each rebuild re-imports the frameworks on
    every rank: seconds of CPU), as taken when the pools closed."""
    for line in _POOL_SUMMARIES:
        terminalreporter.write_line(line)


_POOL_SUMMARIES: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The rank pools (tests.pool) leave with the session, not at interpreter exit after pytest's report."""
    if "tests.pool" in __import__("sys").modules:
        from tests.pool import close_pools, summaries

        _POOL_SUMMARIES[:] = summaries()   # printed by pytest_terminal_summary, which runs after this hook
        close_pools()
