"""The raw collectives: the ONLY module of the library, besides the baselines' and the DeepSpeed guard's own
``comm.py``, that calls torch.distributed collectives (``tests/test_comm_choke_point.py`` enforces it).

Every byte DSP moves goes through the few functions below; the rest of
``dsp_plugin.comm`` packs, checks and unpacks around them. A call that fails because a
peer left raises that peer's own error when it posted one (``dsp_plugin.failures``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
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


def released(group: dist.ProcessGroup | None, *tensors: torch.Tensor, timeout_s: float = 1.0) -> None:
    """Return once no thread of gloo's process group holds ``tensors`` any more (the caller holds one reference each).

    A gloo collective's work keeps its tensors until the worker thread that ran it drops the work, a few
    microseconds *after* the caller's ``wait`` returned (measured: 1-2 % of the checks' all_gathers still
    held when the exchange returned). The tensors' Python objects are then kept alive for that thread to
    release, which takes the GIL. If the process is exiting by then (a check's error raised right after
    the exchange, uncaught), the interpreter is finalizing, the thread cannot take the GIL and ends
    inside a ``noexcept`` destructor: ``terminate called without an active exception``, SIGABRT (issue
    25 item 10). Waiting here (with the GIL released) makes the exchange leave nothing behind.
    Only for gloo on CPU: NCCL's work is released by its watchdog, later, and a fake group never.
    """
    if not tensors or any(t.device.type != "cpu" for t in tensors) or dist.get_backend(group) != "gloo":
        return
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(1e-4)   # a real wait: sleep(0) hands the GIL back before a waiting thread can take it


@_naming_peers
def _all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_fn(out, inp, group=group)


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
    """Mean of ``tensor`` over ``group`` (a new tensor; for logging losses across DP ranks)."""
    out = tensor.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out.div_(dist.get_world_size(group))
    return out


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
