"""The rank pool itself (``tests.pool``): a hang fails within its timeout and the next run still passes,
what a run leaves behind does not reach the next one, and a failing rank's traceback reaches pytest's report.

Each test runs on the session's pool for 2 ranks, as every pooled test does; where a test kills the pool
on purpose it says so, and the next run starts a new one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import WorkerError, run_distributed
from tests.pool import pool

ROOT = Path(__file__).resolve().parents[1]


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _hang_on_rank1(rank: int, world_size: int) -> str:
    if rank == 1:
        time.sleep(3600)          # a rank that never comes back (a deadlock, a lost peer)
    return "rank 0 left"


def test_a_hang_on_rank_1_fails_within_its_timeout_and_the_next_run_passes() -> None:
    run_distributed(_pid, 2)
    started = pool(2).starts
    start = time.monotonic()
    # rank 0 returned and waits at the run's final meeting for rank 1: neither reported
    with pytest.raises(WorkerError, match=r"ranks \[0, 1\] did not finish within 6s"):
        run_distributed(_hang_on_rank1, 2, timeout=6)
    waited = time.monotonic() - start
    assert waited < 6 + 15, f"the hang was reported after {waited:.0f} s, its timeout is 6 s"
    assert not pool(2).alive, "the pool was kept after a rank hung"
    pids = run_distributed(_pid, 2)            # a new pool, and it works
    assert pool(2).starts == started + 1, (started, pool(2).starts)
    assert pids == pool(2).pids()


def _leave_things_behind(rank: int, world_size: int) -> None:
    """Everything a careless test body could leave in its process."""
    from dsp_plugin import Topology, checks, parallelize, set_topology
    from dsp_plugin.testing.tiny import tiny_wan

    set_topology(Topology.build(dsp=1))                       # a topology other than the world's
    torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: out * 0 if torch.is_tensor(out) else out)
    checks.set_check_mode("always")
    os.environ["DSP_CHECK"] = "0"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(123)
    sys.argv[:] = ["left", "behind"]
    _leave_things_behind.model = parallelize(tiny_wan(), group=torch.distributed.group.WORLD)
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    torch._dynamo.config.wrap_top_frame = True                 # set, not patched
    _leave_things_behind.model.set_attention_backend("flex")   # diffusers makes it the process-wide backend
    from dsp_plugin.megatron.cpu import install_cuda_shim

    install_cuda_shim(training=True)   # Megatron's CPU shim, never restored: torch.cuda.Stream is a lambda


def _observe(rank: int, world_size: int) -> dict[str, Any]:
    """What the next test body sees: it must equal what a fresh process sees."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from dsp_plugin import checks, get_topology, split

    topology = get_topology()
    x = torch.arange(12.0).view(1, 4, 3)
    out = torch.nn.Linear(3, 3)(split(x, 1))
    return {"topology": (topology.dsp, topology.dp, topology.world_size), "check_mode": checks.check_mode(),
            "env": os.environ.get("DSP_CHECK"), "dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "draw": torch.randn(3).tolist(), "out": out.detach().tolist(),
            "hooks": len(torch.nn.modules.module._global_forward_hooks), "argv_changed": sys.argv == ["left", "behind"],
            "compiled_frames": len(torch._dynamo.utils.counters["frames"]), "pid": os.getpid(),
            "attention_backend": str(_AttentionBackendRegistry.get_active_backend()[0]),
            "wrap_top_frame": torch._dynamo.config.wrap_top_frame,
            "cuda": (torch.cuda.is_available(), type(torch.cuda.Stream).__name__, torch.ones(1, device="cuda").device.type
                     if torch.cuda.is_available() else "no cuda")}


def test_a_run_that_leaves_a_hook_or_a_topology_behind_does_not_change_the_next_run() -> None:
    fresh = run_distributed(_observe, 2, own_processes=True)     # new processes: the reference
    pooled = run_distributed(_observe, 2)
    run_distributed(_leave_things_behind, 2)
    after = run_distributed(_observe, 2)
    assert [r["pid"] for r in after] == [r["pid"] for r in pooled], "the pool was rebuilt: the reset was not tested"
    assert after == pooled, (after, pooled)      # the draws too: each run starts from the pool's own seed
    for r in (*fresh, *pooled):     # a fresh process draws from a random seed (torch 2.13), unlike a pooled run
        del r["pid"], r["draw"], r["out"]
    assert pooled == fresh, (pooled, fresh)
    assert pooled[0]["hooks"] == 0 and pooled[0]["topology"] == (2, 1, 2) and pooled[0]["check_mode"] == "first"


_HELD: list[Any] = []   # what a careless test body keeps: a module global of its own


def _hold_groups(rank: int, world_size: int, count: int) -> int:
    """Make ``count`` process groups and keep them past the run (as DeepSpeed's ZeRO-3 parameters keep theirs)."""
    import torch.distributed as dist

    for _ in range(count):
        group = dist.new_group(list(range(world_size)))
        t = torch.ones(1)
        dist.all_reduce(t, group=group)   # gloo connects a group's pairs at its first collective
        _HELD.append(group)
    return _gloo_threads_here()


def _gloo_threads_here(rank: int = 0, world_size: int = 0) -> int:
    """gloo's threads in this rank, its own group's connected first (a collective)."""
    import torch.distributed as dist

    from tests.pool import _gloo_threads

    dist.all_reduce(torch.ones(1))
    return _gloo_threads()


def test_a_run_that_leaves_process_groups_held_gets_the_pool_rebuilt() -> None:
    """A group something still holds keeps its gloo threads after ``destroy_process_group`` (its TCP loop keeps
    waking: CPU for the rest of the session). A few are kept; past ``_GLOO_THREADS_KEPT`` the pool is rebuilt, and
    the next run finds only its own group's threads (a TCP loop and two workers)."""
    from tests.pool import _GLOO_THREADS_KEPT

    too_many = _GLOO_THREADS_KEPT // 3 + 1
    if run_distributed(_gloo_threads_here, 2) != [3, 3]:   # earlier tests left some (below the limit): shed them
        run_distributed(_hold_groups, 2, too_many)
    assert run_distributed(_gloo_threads_here, 2) == [3, 3]   # the pool up (a shed one restarts here), clean
    started = pool(2).starts
    run_distributed(_hold_groups, 2, too_many)
    assert run_distributed(_gloo_threads_here, 2) == [3, 3]   # only this run's own group
    assert pool(2).starts == started + 1, (started, pool(2).starts)
    assert pool(2).rebuilt_after[-1][1] == "a rank could not reset its state, or held leaked gloo threads"
    held = run_distributed(_hold_groups, 2, 2)
    assert held == [3 * 3, 3 * 3] and pool(2).starts == started + 1, (held, pool(2).starts)  # 2 held: kept


def _raise_on_rank1(rank: int, world_size: int) -> None:
    def a_distinctive_helper_name() -> None:
        raise ValueError(f"planted failure on rank {rank}")

    if rank == 1:
        a_distinctive_helper_name()


def _raise_on_every_rank(rank: int, world_size: int) -> None:
    raise ValueError(f"refused on rank {rank}")


def test_a_failing_rank_s_traceback_reaches_the_error_and_the_pool_is_rebuilt() -> None:
    pids = run_distributed(_pid, 2)
    with pytest.raises(WorkerError) as info:
        run_distributed(_raise_on_rank1, 2)
    text = str(info.value)
    assert "rank 1 raised ValueError: planted failure on rank 1" in text, text
    assert "Traceback (most recent call last)" in text and "a_distinctive_helper_name" in text, text
    assert f"{Path(__file__).name}" in text, text
    assert run_distributed(_pid, 2) != pids, "a run that failed on one rank only kept the pool"
    # a refusal on every rank (what the bad-input tests expect) keeps it: the ranks agree and were reset
    pids = run_distributed(_pid, 2)
    with pytest.raises(WorkerError, match="refused on rank 0"):
        run_distributed(_raise_on_every_rank, 2)
    assert run_distributed(_pid, 2) == pids


_FAILING_TEST = '''
from tests.distributed import run_distributed
from tests.test_pool import _raise_on_rank1


def test_planted():
    run_distributed(_raise_on_rank1, 2)
'''


def test_a_failing_rank_s_traceback_reaches_the_pytest_report(tmp_path: Path) -> None:
    test_file = ROOT / "tests" / f"test_zz_pool_planted_{os.getpid()}.py"    # inside tests/: its conftest applies
    test_file.write_text(textwrap.dedent(_FAILING_TEST))
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        test_file.unlink()
    report = done.stdout + done.stderr
    assert done.returncode == 1 and "1 failed" in report, report
    for line in ("rank 1 raised ValueError: planted failure on rank 1", "in a_distinctive_helper_name",
                 "Traceback (most recent call last)"):
        assert line in report, f"{line!r} is missing from pytest's report:\n{report}"


_KILLED_PARENT = '''
import os, sys
sys.path.insert(0, sys.argv[1])
from tests.distributed import run_distributed
from tests.test_pool import _pid

print(*run_distributed(_pid, 2), flush=True)
os._exit(9)     # as pytest killed by CI's limit: no atexit, no close
'''


def test_the_ranks_leave_when_the_test_process_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "out.txt"
    with log.open("w") as out:   # a file, not a pipe: a rank left behind would hold a pipe open
        done = subprocess.run([sys.executable, "-c", _KILLED_PARENT, str(ROOT)], stdout=out, stderr=subprocess.STDOUT, check=False,
                              timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    text = log.read_text()
    assert done.returncode == 9, text[-3000:]
    pids = [int(p) for p in text.split("\n")[-2].split()]
    assert len(pids) == 2, text[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in pids), f"pool ranks {pids} outlived the killed test process"
