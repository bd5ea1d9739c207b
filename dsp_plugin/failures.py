"""An error one rank sees alone reaches its peers as that error, not as "Connection closed by peer".

When one rank raises on its own (a check of its own shard, a shape error in the model's code on
its frames, a Megatron bucket with fewer frames than ranks), its peers are already waiting in the
next collective. They learn only that the connection closed when the failing process exits, or,
if it lingers, that the collective timed out: neither names the cause, and torchrun's summary may
show a peer's error first.

So the failing rank *posts* its error in the process group's store (``dsp_plugin/failed/<rank>``,
set before its process exits: the store is the one rendezvous every rank shares, and under torchrun
it lives in the agent, which outlives the workers), and a rank whose collective fails reads the
posts and raises ``PeerFailure`` naming the first rank's error, chained to its own collective error.
Posting happens where an error leaves a parallelized model's forward (``plan.runtime``) and a launch's
main (``launch_main``); reading, where a collective of ``dsp_plugin.comm`` fails and where a
launch's main sees a communication error from anyone's collective (Megatron's, DeepSpeed's).
``launch_main`` also wraps torchrun's ``record``, so torchrun's error file and summary name the
first failure with its traceback. Nothing here issues a collective; the store is only read after a
collective has already failed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["PeerFailure", "explain", "is_communication_failure", "launch_main", "post", "posted", "reporting"]

_KEY = "dsp_plugin/failed/{}"
_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out", "Timeout",
            "NCCL error", "DistBackendError", "ProcessGroupNCCL", "gloo")
_posted = False

F = TypeVar("F", bound=Callable[..., Any])


class PeerFailure(RuntimeError):
    """A peer raised first; this rank's collective then failed. Names the peer's error (raised on the peers)."""


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a backend without one): nothing to post or read
        return None


def is_communication_failure(exc: BaseException) -> bool:
    """A collective's failure because a peer left or went silent (not a cause of its own)."""
    if isinstance(exc, PeerFailure):
        return True
    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if k)
    text = str(exc)
    return isinstance(exc, kinds) or (isinstance(exc, RuntimeError) and any(m in text for m in _MARKERS))


def post(exc: BaseException) -> None:
    """Post this rank's error for its peers (its first one only; never a communication failure)."""
    global _posted
    if _posted or is_communication_failure(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    store = _store()
    if store is None:
        return
    try:
        store.set(_KEY.format(dist.get_rank()), f"{time.time():.6f} {type(exc).__name__}: {exc}"[:4000])
        _posted = True
    except Exception:  # noqa: BLE001 - best effort: the error itself is raised anyway
        pass


def posted() -> list[tuple[float, int, str]]:
    """The errors other ranks posted, earliest first: ``[(time, rank, message)]``."""
    store = _store()
    if store is None:
        return []
    found = []
    me = dist.get_rank()
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank)
        try:
            if rank == me or not store.check([key]):
                continue
            stamp, _, message = store.get(key).decode(errors="replace").partition(" ")
            found.append((float(stamp), rank, message))
        except Exception:  # noqa: BLE001 - the store left with the failing rank: nothing to tell
            return sorted(found)
    return sorted(found)


def explain(exc: BaseException) -> BaseException:
    """``exc``, or a ``PeerFailure`` naming the first peer's posted error when ``exc`` is a communication failure."""
    if isinstance(exc, PeerFailure) or not is_communication_failure(exc):
        return exc
    found = posted()
    if not found:
        return exc
    _, rank, message = found[0]
    return PeerFailure(f"rank {rank} failed first: {message} (this rank's collective then failed: "
                       f"{str(exc).splitlines()[0][:200]})")


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Around a rank's work, inside the code that tears its process group down: post this rank's own error;
    turn a communication failure into the ``PeerFailure`` of the rank that failed first."""
    try:
        yield
    except BaseException as exc:
        clearer = explain(exc)
        if clearer is not exc:
            raise clearer from exc
        post(exc)
        raise


def launch_main(fn: F) -> F:
    """Decorate a launch's ``main``: torchrun's error file (``record``), this rank's error posted, a peer's named.

    A rank that fails posts its error before its process exits; a rank whose collective then
    fails (anyone's: Megatron's, DeepSpeed's, ours) raises ``PeerFailure`` naming it.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    @functools.wraps(fn)
    def main(*args: Any, **kwargs: Any) -> Any:
        with reporting():   # a main that destroys its group in ``finally`` also wraps its work in ``reporting``
            return fn(*args, **kwargs)

    return record(main)  # type: ignore[return-value]
