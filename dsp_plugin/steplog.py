"""What DSP did in a training step, as log lines: the groups, the all-to-alls and the bytes they sent.

One wording for every launch (``make train`` prints the same per step in its table):

    from dsp_plugin.steplog import count_step, describe_step, describe_topology
    print(describe_topology(topology))                  # once, after the groups exist
    with count_step(first) as acct:                      # counts only when ``first`` (step 1)
        ...forward, backward...
    if first: print(*describe_step(acct, topology), sep="\\n")

``count_step`` is ``CommAccounting`` (every collective at the dispatcher, C++ callers such
as DDP and DeepSpeed's ZeRO included) or nothing: the traffic of a step is the same every
step, and counting costs about 10 us per operator, so launches count one step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.topology import Topology

__all__ = ["count_step", "describe_step", "describe_topology", "log_first_call"]


def describe_topology(topology: Topology | None) -> str:
    """``DSP: tp(1) x dsp(2) x dp(2) x pp(1) = 4; rank 0 at ...; DSP groups [[0, 1], [2, 3]]``."""
    if topology is None:
        return "DSP: off (one process, or no topology set)"
    groups = topology.layout.get("dsp")
    return f"DSP: {topology.describe()}" + (f"; DSP groups {groups}" if groups else "")


def count_step(enabled: bool = True) -> contextlib.AbstractContextManager[CommAccounting | None]:
    """``CommAccounting(activations=False)`` when ``enabled``, else a context that yields None."""
    return CommAccounting(activations=False) if enabled else contextlib.nullcontext()


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def describe_step(acct: CommAccounting, topology: Topology | None = None) -> list[str]:
    """Log lines for one counted step, as this rank saw it.

    The all-to-alls in the DSP group (the switches, split and gather excluded:
    those are all-gathers or local slices), forward and backward, with the bytes
    this rank sent; then every other collective by op and group size.
    """
    dsp_ranks: Any = None
    if topology is not None and topology.dsp_group is not None:
        dsp_ranks = topology.dsp_group
    lines = []
    fwd = acct.select("all_to_all", "forward", group=dsp_ranks)
    bwd = acct.select("all_to_all", "backward", group=dsp_ranks)
    sent = sum(r.bytes_sent for r in fwd + bwd)
    per = f", {_kib(fwd[0].bytes_sent)} per forward switch" if fwd else ""
    lines.append(f"DSP step traffic (this rank): {len(fwd)} all-to-alls forward, {len(bwd)} backward, "
                 f"{_kib(sent)} sent{per}")
    others: dict[tuple[str, str, int], list[int]] = {}
    ours = {id(r) for r in fwd + bwd}
    for r in acct.records:
        if id(r) in ours or r.phase == "check":
            continue
        row = others.setdefault((r.op, r.phase, r.group_size), [0, 0])
        row[0] += 1
        row[1] += r.bytes_sent
    for (op, phase, size), (count, nbytes) in sorted(others.items()):
        where = "in backward" if phase == "backward" else "outside backward"
        lines.append(f"  other: {count} x {op} ({where}, group of {size}), {_kib(nbytes)} sent")
    return lines


def log_first_call(step_fn: Callable[..., Any], *, log: Callable[[str], None] = print,
                   topology: Callable[[], Topology | None] | None = None) -> Callable[..., Any]:
    """``step_fn`` (a train step: Megatron's ``train_step``, a loop body) counted on its first call.

    After that call ``log`` gets ``describe_topology`` and ``describe_step``'s
    lines (pass ``print_rank_0`` to log from rank 0 only); later calls run
    uncounted. ``topology`` defaults to ``dsp_plugin.topology.get_topology``.
    """
    from dsp_plugin.topology import get_topology

    done = False

    @functools.wraps(step_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done:
            return step_fn(*args, **kwargs)
        done = True
        with count_step() as acct:
            out = step_fn(*args, **kwargs)
        topo = (topology or get_topology)()
        for line in [describe_topology(topo), *describe_step(acct, topo)]:
            log(line)
        return out

    return wrapper
