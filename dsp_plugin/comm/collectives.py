"""The raw collectives: the ONLY module of the library, besides the baselines' and the DeepSpeed guard's own
``comm.py``, that calls torch.distributed collectives (``tests/test_comm_choke_point.py`` enforces it).

Every byte DSP moves goes through the few functions below; the rest of
``dsp_plugin.comm`` packs, checks and unpacks around them. A call that fails because a
peer left raises that peer's own error when it posted one (``dsp_plugin.failures``).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin import failures

__all__ = ["all_reduce_mean", "all_reduce_sum", "all_to_all_single", "broadcast", "meet_and_close", "released"]


def _naming_peers(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A collective that fails because a peer left names the peer's own error (``dsp_plugin.failures``)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            clearer = failures.explain(exc)
            if clearer is exc:
                raise
            raise clearer from exc

    return call


def released(group: dist.ProcessGroup | None, refs: Sequence[weakref.ref[torch.Tensor]], *,
             timeout_s: float = 1.0) -> None:
    """Return once gloo's worker threads have let go of the collective's tensors that ``refs`` point to.

    A gloo collective's work keeps its tensors until the worker thread that ran it drops the work, a few
    microseconds *after* the caller's ``wait`` returned (measured: 13-30 % of ``all_gather_rows`` calls,
    11-16 % of ``all_reduce_mean`` calls still held on return). A tensor's Python object is kept alive
    while C++ holds it, so the drop decrefs it, which takes the GIL. If the process is exiting by then
    (a check's error raised right after the exchange, uncaught; a rank leaving right after a checkpoint's
    last gather), the thread, blocked on the GIL, is given it only once the interpreter is finalizing,
    and exits there inside a ``noexcept`` destructor: ``terminate called without an active exception``,
    SIGABRT (issue 25 item 10; ``examples/train_wan_deepspeed.py`` on a busy machine). Waiting here, with
    the GIL released, makes the collective leave nothing behind.

    The caller keeps weak references only (it has dropped its own): a tensor's Python object dies exactly
    when gloo's thread has dropped it, GIL step included. Its C++ use count would not do: it falls to one
    *before* the thread takes the GIL. Only for gloo: NCCL's work is released by its watchdog, later, and
    a fake group never.
    """
    if not refs or dist.get_backend(group) != "gloo":
        return
    deadline = time.monotonic() + timeout_s
    while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
        time.sleep(1e-4)   # a real wait: sleep(0) hands the GIL back before a waiting thread can take it


@_naming_peers
def _all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_fn(out, inp, group=group)


@_naming_peers
def _reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out`` = this rank's block of ``inp`` (``n`` equal blocks along dim 0) summed over ``group``."""
    # torch 2.13 names it reduce_scatter_single, like all_gather_single (the old name warns)
    scatter_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter_fn(out, inp, group=group)


@_naming_peers
def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, *, recv_splits: list[int] | None,
                      send_splits: list[int] | None, group: dist.ProcessGroup | None,
                      async_op: bool = False) -> Any:
    """``dist.all_to_all_single`` of ``send`` into ``recv`` (split sizes in rows of dim 0; None: even);
    returns the work handle when ``async_op``."""
    return dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                  group=group, async_op=async_op)


@_naming_peers
def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
    """``tensor`` summed over ``group``, in place."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


@_naming_peers
def broadcast(tensor: torch.Tensor, *, group: dist.ProcessGroup) -> None:
    """``tensor`` of group rank 0 on every rank of ``group``, in place (a sampler's noise drawn once)."""
    dist.broadcast(tensor, group=group, group_src=0)


@_naming_peers
def all_reduce_mean(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Mean of ``tensor`` over ``group`` (a new tensor; for logging losses across DP ranks).

    Often a run's last collective (the last step's loss): it returns only once gloo has let go (``released``).
    """
    if group is None or dist.get_world_size(group) == 1:
        return tensor.detach().clone()
    summed = tensor.detach().clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    mean = summed / dist.get_world_size(group)   # a tensor gloo never held
    refs = [weakref.ref(summed)]
    del summed
    released(group, refs)
    return mean


@_naming_peers
def meet_and_close() -> None:
    """Every rank meets once more, then the default process group is destroyed (a launch's clean exit).

    Leaving gloo's teardown to interpreter shutdown lets a rank that exits first abort its peer.
    Call it only where every rank is known to be at the same point (never after an error).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@_naming_peers
def _all_to_all_flat(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                     group: dist.ProcessGroup) -> torch.Tensor:
    """One ``all_to_all_single`` of a flat buffer cut into per-rank blocks (sizes in elements, any may be 0).

    Returns the flat receive buffer: rank ``i``'s block at offset ``sum(recv_splits[:i])``.
    """
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return recv


# -- the traceable forms (torch.compile): torch's functional collectives, seen by dynamo as graph ops ----------


def traced_all_to_all(send: torch.Tensor, *, send_splits: list[int], recv_splits: list[int],
                      group: dist.ProcessGroup) -> torch.Tensor:
    """``all_to_all_single_autograd`` of a flat buffer (sizes in elements): its backward is the reverse
    all-to-all, traced with it (``dsp_plugin.comm.traced``)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(send, recv_splits, send_splits, group)


def traced_all_to_all_bytes(send: torch.Tensor, *, send_splits: list[int], recv_splits: list[int],
                            group: dist.ProcessGroup) -> torch.Tensor:
    """``all_to_all_single`` of a flat buffer without autograd (the FP8 payload's ``uint8`` bytes: its caller,
    ``traced.traced_wire_switch``, routes the gradient through the reverse switch itself)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single(send, recv_splits, send_splits, group))


def traced_all_gather(send: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """``all_gather_tensor`` along dim 0, without autograd (the caller routes the gradient itself)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_tensor(send, 0, group)


def traced_reduce_scatter(send: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """``reduce_scatter_tensor`` (sum) along dim 0, without autograd (the caller routes the gradient itself)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.reduce_scatter_tensor(send, "sum", 0, group)
