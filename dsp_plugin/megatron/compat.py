"""Hooks for megatron-core 0.19.x packaging gaps that hit any ``megatron.training`` launch.

``initialize_megatron`` -> ``_compile_dependencies`` runs ``make`` in
``megatron/core/datasets`` on rank 0 and exits the job when it fails. The
megatron-core wheel ships the compiled ``helpers_cpp`` extension but no
Makefile, so every pip-installed launch dies there (GPU or CPU). The hook
makes the compile step a no-op when the prebuilt extension imports, and
leaves it unchanged otherwise (a source checkout still compiles).

``load_checkpoint`` calls ``sys.exit()`` with status 0 on some load errors;
``fail_on_silent_exit_in_load`` makes that a failure of the launch.

``train()`` logs its first iteration without resetting the log accumulators (so that
a ``--log-interval N`` window keeps it), also when that iteration is itself on a
boundary: with ``--log-interval 1`` the second logged line of every run, fresh or
resumed, prints the mean of two iterations, so a resumed run's second line differs
from the uninterrupted run's although the training is identical (issue 48; upstream
NVIDIA/Megatron-LM#7092). ``reset_log_on_first_boundary`` resets there.

``report_theoretical_memory`` (rank 0, first log) sets ``args.num_query_groups`` to the
head count without ``--group-query-attention``; every later save then warns that the
common state dict's ``args.num_query_groups`` differs between rank 0 and the others.
``agree_on_query_groups`` sets the same value on every rank first.

``pretrain()`` builds the data iterators after ``--load`` has restored the RNG states,
and each ``iter(DataLoader)`` draws a base seed from the default CPU generator: a
resumed run then starts its first iteration one draw (more with validation loaders)
further than the uninterrupted run was when it saved, and every CPU draw after it
(the DSP dropout's seeds, ``dropout.sharded_dropout``) differs (issue 48).
``data_iterators_leave_rng_alone`` builds them under a fork of that generator.

``_compile_dependencies`` imports ``compile_helpers`` from the module at call
time, ``pretrain()`` looks ``build_train_valid_test_data_iterators`` up in its
module, and ``train()`` looks ``training_log`` up in its module at each call, so
replacing the module attributes is enough; no patch file is needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["agree_on_query_groups", "data_iterators_leave_rng_alone", "exit_is_failure", "fail_on_silent_exit_in_load",
           "reset_log_on_first_boundary", "use_prebuilt_dataset_helpers"]


def use_prebuilt_dataset_helpers() -> Callable[[], None]:
    """Install the hook; returns the original ``compile_helpers``."""
    from megatron.core.datasets import utils

    original = getattr(utils.compile_helpers, "__wrapped__", utils.compile_helpers)

    def compile_helpers() -> None:
        """Build the dataset helpers unless the wheel's prebuilt extension is importable."""
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            original()

    compile_helpers.__wrapped__ = original  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers
    return original


@contextlib.contextmanager
def exit_is_failure(what: str) -> Iterator[None]:
    """Turn a ``sys.exit()`` without an error status inside the block into a ``RuntimeError``."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise RuntimeError(f"{what} called sys.exit() without an error status; see the message above") from exc
        raise


def fail_on_silent_exit_in_load() -> None:
    """Megatron's ``load_checkpoint`` calls ``sys.exit()`` (status 0) on some load errors (e.g. "Unable to
    load rng state"); a launch that did not load must fail. Wraps the name ``train()`` and
    ``setup_model_and_optimizer`` call; idempotent. ``train()``'s own ``sys.exit(0)`` after
    ``--exit-interval``/``--exit-duration-in-mins`` is a success and stays one."""
    from megatron.training import training

    if getattr(training.load_checkpoint, "_exit_is_failure", False):
        return
    original = training.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with exit_is_failure("loading the checkpoint"):
            return original(*args, **kwargs)

    load_checkpoint._exit_is_failure = True  # type: ignore[attr-defined]
    training.load_checkpoint = load_checkpoint


def reset_log_on_first_boundary() -> None:
    """Make ``train()``'s first logged iteration reset the log accumulators when it is on a ``--log-interval``
    boundary (NVIDIA/Megatron-LM#7092), so every line of ``--log-interval 1`` is its own iteration's loss;
    off a boundary it stays in the window, as Megatron intends. Wraps the name ``train()`` calls; idempotent."""
    from megatron.training import get_args, training

    if getattr(training.training_log, "_resets_on_first_boundary", False):
        return
    original = training.training_log

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        if kwargs.get("is_first_iteration") and iteration % get_args().log_interval == 0:
            kwargs["is_first_iteration"] = False   # the line is the window: log it and reset
        return original(*args, **kwargs)

    training_log._resets_on_first_boundary = True  # type: ignore[attr-defined]
    training.training_log = training_log


def agree_on_query_groups(args: Any) -> None:
    """Without ``--group-query-attention``, set ``args.num_query_groups`` to the head count on every rank, as
    ``report_theoretical_memory`` does on rank 0 only (the config takes None either way: nothing else changes)."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads


def data_iterators_leave_rng_alone() -> None:
    """Build ``pretrain()``'s data iterators under ``torch.random.fork_rng(devices=[])``: the base seeds the
    ``DataLoader`` iterators draw leave the CPU generator where it was (restored by ``--load`` or seeded), so a
    resumed run's first iteration draws what the uninterrupted run drew there. Idempotent."""
    import torch
    from megatron.training import training

    if getattr(training.build_train_valid_test_data_iterators, "_leaves_rng_alone", False):
        return
    original = training.build_train_valid_test_data_iterators

    @functools.wraps(original)
    def build_train_valid_test_data_iterators(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    build_train_valid_test_data_iterators._leaves_rng_alone = True  # type: ignore[attr-defined]
    training.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators
