"""A persistent pool of gloo rank processes per world size, reused by every test that only needs ranks.

Starting 2-4 processes per test, each importing torch (and deepspeed, megatron-core or diffusers)
again, cost seconds per test before any assertion on 2 cores. A pool starts its processes once per
test session (per world size, when a test first asks for it) and then runs one test body after
another on them, as DeepSpeed's ``DistributedTest`` with ``reuse_dist_env`` and PyTorch's
``MultiProcContinuousTest`` do.

The ranks are forked from a ``multiprocessing`` fork server that imported torch, torch.distributed,
DeepSpeed, megatron-core, megatron.training and diffusers' models and pipelines once (``_PRELOAD``):
starting or rebuilding a pool of 4 costs about a second instead of every rank importing them again (11 s
for 4 ranks, 6 more once a body imports the frameworks, measured on the 2-core machine).
``DSP_TEST_POOL_START=spawn`` starts new interpreters.

Per run, each rank (``_worker``):

- takes the parent's environment and working directory as they are at the call (what a spawned
  process would have inherited), the fresh process's seeds, and torch's global defaults;
- builds a new gloo process group on a new file store, meets its peers, calls the test body, meets
  them again and destroys the group (``dsp_plugin.spawn.run_rank``, the same code ``spawn`` runs); a
  fresh group per run costs milliseconds, and no run can read a message a failed run left on a pair;
- then resets what a test body can leave behind in the process: the topology, the cross-rank
  check's memory of signatures, nn.Module global hooks, compiled graphs, DeepSpeed's and Megatron's
  module-level groups and arguments, Megatron's CPU shim of ``torch.cuda``, environment, working directory,
  ``sys.argv`` and signal handlers.

A run that times out, whose rank dies, or that fails on some ranks but not all gets the pool killed;
the next run starts a new one. A run whose every rank raised keeps it (a refusal on every rank is
what the bad-input tests expect; each rank's state was reset as after any run).
"""

from __future__ import annotations

import atexit
import copy
import gc
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from dsp_plugin.spawn import SpawnError, collect, run_rank

__all__ = ["RankPool", "close_pools", "pool", "summaries"]

_START_TIMEOUT_S = 180
_SIGNALS = tuple(s for s in (signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2,
                             signal.SIGALRM, signal.SIGPIPE))


class RankPool:
    """``world_size`` worker processes that run ``fn(rank, world_size, *args)`` on a new gloo group each time."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.starts = 0          # how many times processes were started (a test of the pool reads it)
        self.rebuilt_after: list[tuple[str, str]] = []   # (the test, why) of each kill: the session summary's
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._retiring: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._next = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        self.kill()
        ctx = _context()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"dsp-pool{self.world_size}-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._retiring = [ctx.Event() for _ in range(self.world_size)]
        # not daemonic: a test body may start DataLoader workers
        self._procs = [ctx.Process(target=_worker, args=(r, self._tasks[r], self._results, self._retiring[r],
                                                         os.getpid()),
                                   name=f"pool-rank{r}") for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.starts += 1
        _, errors, complete = collect(self._results, self._procs, _START_TIMEOUT_S, task="ready")
        if errors or not complete:
            self.kill()
            raise SpawnError("the rank pool did not start:\n" + "\n".join(errors))

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float, collective_timeout_s: float,
            final_barrier: bool = True) -> list[Any]:
        """Like ``dsp_plugin.spawn.spawn`` (same errors, same messages), on the pool's processes."""
        if not self.alive:
            self._start()
        self._next += 1
        task = self._next
        assert self._tmp is not None
        init_file = os.path.join(self._tmp.name, f"store-{task}")
        payload = pickle.dumps((fn, args, dict(os.environ), os.getcwd(), init_file, collective_timeout_s,
                                final_barrier, self.world_size))
        for queue in self._tasks:
            queue.put((task, payload))
        healthy, blobs, errors, complete = False, {}, [], None   # None: interrupted before any report
        try:
            blobs, errors, complete = collect(self._results, self._procs, timeout, task=task)
            # every rank reported, and alike (all returned or all raised), and each could reset its state
            healthy = complete and (not errors or not blobs) and not any(e.is_set() for e in self._retiring)
        finally:
            if not healthy:   # a timeout, a dead rank, a failure on some ranks only, or the test interrupted
                self.rebuilt_after.append((os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
                                           _why_unhealthy(complete, errors, blobs)))
                self.kill()
        if errors:
            raise SpawnError("\n".join(sorted(errors)))
        return [pickle.loads(blobs[r]) for r in range(self.world_size)]

    def summary(self) -> str:
        """One line for the session's end: how often this pool started, and after which tests it was rebuilt."""
        tests = "; ".join(f"{t} ({w})" for t, w in self.rebuilt_after)
        return (f"rank pool of {self.world_size}: started {self.starts} time(s), rebuilt {len(self.rebuilt_after)} "
                f"time(s){' after: ' + tests if tests else ''}")

    def kill(self) -> None:
        """Stop every process now (a rank may be stuck in a collective); the next run starts new ones."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._results, self._retiring = [], [], None, []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def close(self) -> None:
        """Ask every process to leave, then kill what did not."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()


#: what the fork server imports once, before it forks any rank: a rank is a fork of a process that has already
#: imported torch and the frameworks, not a new interpreter importing them again. ``import diffusers`` loads its
#: models and pipelines lazily, at a body's first ``from diffusers import WanTransformer3DModel`` (2.8 s a rank),
#: hence the Wan model's module (it loads the models' shared code) and the pipelines' base; megatron.training
#: for the launches' code the Megatron tests call in a rank. With them, a pool's first body that uses diffusers
#: and megatron.training imports in 0.7 s on 2 ranks and 1.4 s on 4, against 3.7 s and 8.0 s without.
_PRELOAD = ("torch", "torch.distributed", "tests.pool", "deepspeed", "megatron.core", "megatron.training",
            "diffusers", "diffusers.models.transformers.transformer_wan", "diffusers.pipelines.pipeline_utils")


def _context() -> Any:
    """The ranks' start method: ``forkserver``, its server preloading ``_PRELOAD`` (DSP_TEST_POOL_START=spawn
    starts each rank as a new interpreter instead)."""
    method = os.environ.get("DSP_TEST_POOL_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _why_unhealthy(complete: bool | None, errors: list[str], blobs: dict[int, bytes]) -> str:
    """Why ``RankPool.run`` kills its processes (``complete`` None: the run was interrupted)."""
    if complete is None:
        return "interrupted"
    if not complete:
        return "timeout or a dead rank"
    if errors and blobs:
        return "failed on some ranks only"
    return "a rank could not reset its state, or held leaked gloo threads"


_POOLS: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """The session's pool for ``world_size`` ranks (started at its first run)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


def summaries() -> list[str]:
    return [p.summary() for _, p in sorted(_POOLS.items())]


def close_pools() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


atexit.register(close_pools)


# --- the worker side -----------------------------------------------------------------------------------------


def _leave_with_the_parent(parent: int) -> None:
    """A pytest killed (CI's limit, ^C, a timeout signal) cannot ask its ranks to leave: they go by themselves,
    even in the middle of a test body, as soon as the test process that started them is gone. (Their parent
    is the fork server, which stays while they do: it is the test process that is watched.)"""
    while True:
        time.sleep(1)
        if not _running(parent):
            os._exit(3)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed pytest its own parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _worker(rank: int, tasks: Any, results: Any, retiring: Any, parent: int) -> None:
    threading.Thread(target=_leave_with_the_parent, args=(parent,), daemon=True, name="pool-watchdog").start()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    fresh = _Fresh()
    results.put(("ready", rank, "ok", None))
    while True:
        item = tasks.get()
        if item is None:
            return
        task, payload = item
        try:
            fn, args, env, cwd, init_file, collective_timeout_s, final_barrier, world_size = pickle.loads(payload)
        except BaseException as exc:  # noqa: BLE001 - a test module that fails to import here
            results.put((task, rank, "error", f"{type(exc).__name__} while loading the test body: {exc}"))
            continue
        fresh.enter(env, cwd)
        try:
            status, value = run_rank(fn, rank, world_size, init_file, args, collective_timeout_s, final_barrier,
                                     "gloo")
            if status == "ok":
                try:
                    value = pickle.dumps(value)
                except Exception as exc:  # noqa: BLE001
                    status, value = "error", f"the test body's return value does not pickle: {exc!r}"
        finally:
            if not fresh.leave():
                retiring.set()   # before the report: the parent reads it with the report, and kills the pool
        results.put((task, rank, status, value))


class _Fresh:
    """What a newly spawned rank would start with, put back around every run."""

    def __init__(self) -> None:
        import torch

        self.env = dict(os.environ)
        self.argv = list(sys.argv)
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.diffusers = _attention_registry_state()
        self.compile_configs = _compile_configs()
        self.cuda = _cuda_namespaces()

    def enter(self, env: dict[str, str], cwd: str) -> None:
        import torch

        os.environ.clear()
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.chdir(cwd)
        torch.manual_seed(self.seed)
        random.seed(0)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(0)

    def leave(self) -> bool:
        """Put back what a run may have changed; False when something could not be (then the pool is rebuilt)."""
        import torch

        clean = True
        for reset in _RESETS:
            try:
                reset()
            except Exception:  # noqa: BLE001 - said on stderr; the parent rebuilds the pool
                print(f"rank pool: {reset.__name__} failed; this pool is rebuilt before the next run\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
                clean = False
        _put_attention_registry_back(self.diffusers)
        _put_cuda_back(self.cuda)
        with warnings.catch_warnings():  # loading names settings torch deprecated ("does not do anything")
            warnings.simplefilter("ignore", FutureWarning)
            for config, saved in self.compile_configs:
                config.load_config(saved)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        torch.set_num_threads(1)
        sys.argv[:] = self.argv
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        os.environ.clear()
        os.environ.update(self.env)
        gc.collect()
        left = _gloo_threads()
        if left > _GLOO_THREADS_KEPT:
            print(f"rank pool: {left} gloo threads are left by the runs since this pool started (process groups "
                  f"something still holds: a ZeRO-3 parameter, a hook cycle through C++); this pool is rebuilt "
                  f"before the next run", file=sys.stderr, flush=True)
            clean = False
        return clean


#: a process group's threads (gloo's TCP loop and two ProcessGroupGloo workers) outlive ``destroy_process_group``
#: while anything holds the group (DeepSpeed's ZeRO-3 parameters keep theirs: 19 groups a test; FSDP's device
#: meshes 3-9); ``shutdown()`` and ``abort()`` do not stop them. Each idle TCP loop still wakes and costs CPU: in a
#: full suite the leaked loops of one rank had used 209 s of CPU after 56 minutes, more than the rank's own test
#: code (86 s). A rank holding more than this many such threads is rebuilt after the run.
_GLOO_THREADS_KEPT = 30


def _gloo_threads() -> int:
    """gloo's threads in this process (none left once every process group is gone; Linux: /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                count += f.read().startswith(("gloo", "pt_gloo"))
        except OSError:   # a thread that ended meanwhile
            pass
    return count


def _compile_configs() -> list[tuple[Any, bytes]]:
    """dynamo's, AOTAutograd's and inductor's settings as imported (a test may set one without a patch)."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    return [(c, c.save_config()) for c in (torch._dynamo.config, torch._functorch.config, torch._inductor.config)]


def _cuda_namespaces() -> list[tuple[Any, dict[str, Any]]]:
    """``torch.cuda``'s, ``torch.cuda.random``'s and ``torch.accelerator``'s names as imported: Megatron's CPU
    shim (``dsp_plugin.megatron.cpu.install_cuda_shim``, which a test body may install without restoring)
    replaces ``torch.cuda.Stream`` and the device queries, and a later import that reads them fails
    (diffusers' ``torch.cuda.Stream | None`` annotations)."""
    import torch

    return [(ns, dict(vars(ns))) for ns in (torch.cuda, torch.cuda.random, torch.accelerator)]


def _put_cuda_back(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    cpu = sys.modules.get("dsp_plugin.megatron.cpu")
    while cpu is not None and cpu._MODE:      # the shim's TorchFunctionMode (cuda tensors made on the CPU)
        cpu._MODE.pop().__exit__(None, None, None)
    for ns, names in saved:
        for name, value in names.items():
            if getattr(ns, name, None) is not value:
                setattr(ns, name, value)


def _attention_registry_state() -> dict[str, Any]:
    """diffusers' attention-backend registry as imported: ``set_attention_backend`` makes its backend the
    process-wide active one, and a test may register a backend of its own in a slot."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    return {name: copy.copy(value) for name, value in vars(registry).items()
            if name.startswith("_") and not name.startswith("__") and not callable(value)
            and not isinstance(value, (classmethod, staticmethod))}


def _put_attention_registry_back(state: dict[str, Any]) -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    for name, value in state.items():
        setattr(registry, name, copy.copy(value))


def _reset_dsp_plugin() -> None:
    from dsp_plugin import checks, failures
    from dsp_plugin.plan import recompute
    from dsp_plugin.topology import set_topology

    set_topology(None)
    checks.forget_signatures()
    checks.set_check_mode(None)
    failures._posted = False
    recompute._current = None
    # a run that raised inside a forward may leave open frames, Heads calls or a check in progress behind
    for name, module in list(sys.modules.items()):
        if name.startswith("dsp_plugin") and isinstance(getattr(module, "_local", None), threading.local):
            module._local.__dict__.clear()


def _reset_torch() -> None:
    import torch
    from torch.nn.modules import module

    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks"):
        hooks = getattr(module, name, None)
        if hooks is not None:
            hooks.clear()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if "torch.distributed.tensor" in sys.modules:
        # DTensor caches its sharding decisions by mesh equality: an equal mesh of the next run would find this
        # run's entries, whose process groups died with this run's ("Could not resolve the process group ...")
        from torch.distributed.tensor._redistribute import _gen_transform_infos
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        _gen_transform_infos.cache_clear()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _reset_deepspeed() -> None:
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            setattr(groups, name, {})
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device",
                     "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK"):
            if hasattr(groups, name):
                setattr(groups, name, None)
        groups.expert_tensor_parallel_world_size = 1


def _reset_megatron() -> None:
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None:
        state.destroy_model_parallel()
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None:
        global_vars.destroy_global_vars()
    calculator = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calculator is not None:
        calculator.destroy_num_microbatches_calculator()
    rng = sys.modules.get("megatron.core.tensor_parallel.random")
    if rng is not None:
        rng.get_cuda_rng_tracker().reset()


_RESETS = (_reset_dsp_plugin, _reset_torch, _reset_deepspeed, _reset_megatron)
