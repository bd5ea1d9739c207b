"""One process plays one rank of a large job: torch's ``fake`` process-group backend and fake tensors.

``fake_world(world_size, tp=, dsp=)`` initialises ``torch.distributed`` with the ``fake``
backend (``torch.testing._internal.distributed.fake_pg``: every collective returns at once
and moves nothing) as rank 0 of ``world_size`` and installs the project's ``Topology`` on it,
so ``dsp_plugin.parallelize``, the primitives and ``CommAccounting`` run their ordinary code:
the collectives they issue, with their bytes and groups, are the ones a real rank 0 issues.
Rank 0 holds the most tokens: a dim of length L on N ranks is cut like ``torch.tensor_split``
(the first ``L % N`` ranks hold one more).

Under ``FakeTensorMode`` no tensor has memory or values: shapes, dtypes and strides only. So
the cross-rank fingerprint check (``dsp_plugin.checks``), which compares values the fake
backend never delivers, is switched off inside the block (it issues no model traffic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from dsp_plugin.checks import set_check_mode
from dsp_plugin.topology import Topology, get_topology, set_topology

__all__ = ["fake_world"]

#: c10d's coalesced collectives (Megatron's DDP reduces its buckets through ``_coalescing_manager``) have no
#: fake-tensor kernel in torch 2.13 (``torch/distributed/_meta_registrations.py`` leaves them out as deprecated);
#: the dry run gives them the one torch gives every other c10d collective.
_COALESCED = ("allreduce_coalesced_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
              "reduce_scatter_tensor_coalesced_")
_LIBRARY: list[object] = []


def _register_coalesced() -> None:
    import torch
    from torch.distributed._meta_registrations import create_fakework

    if _LIBRARY:
        return
    library = torch.library.Library("c10d", "IMPL")
    for name in _COALESCED:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{name}", "Meta"):
            library.impl(name, lambda *args: create_fakework(args, return_first_arg=False), "Meta")
    _LIBRARY.append(library)


@contextlib.contextmanager
def fake_world(world_size: int, *, tp: int = 1, dsp: int = 1) -> Iterator[Topology]:
    """Rank 0 of ``world_size`` fake ranks with ``Topology.build(tp=tp, dsp=dsp)`` installed (DP is the rest)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised in this process; the dry run "
                           "needs a process of its own (it plays rank 0 of a fake world)")
    _register_coalesced()
    saved_topology = get_topology()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        topology = Topology.build(tp=tp, dsp=dsp)
        set_topology(topology)
        set_check_mode("off")
        yield topology
    finally:
        set_check_mode(None)  # back to DSP_CHECK
        set_topology(saved_topology)
        dist.destroy_process_group()
