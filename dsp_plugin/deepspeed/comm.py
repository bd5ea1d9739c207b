"""The one collective the DeepSpeed integration issues itself, besides the guard's.

Besides ``dsp_plugin.comm`` and ``dsp_plugin.baselines.comm``, this is the only
module allowed to call torch.distributed collectives (``tests/test_comm_choke_point.py``),
so the integration's own traffic is easy to audit: a tiny all-gather twice per
checkpoint save (``checkpoint.py``: the save id, then "every manifest is
written"). The first-forward guard exchanges through ``dsp_plugin.comm.exchange_words``
(the primitives' check format). Everything else is DeepSpeed's.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from dsp_plugin.comm.collectives import released

__all__ = ["all_gather_rows"]


def all_gather_rows(row: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D ``row`` (same length on all ranks), stacked in group-rank order: ``[n, len]``.

    The list form of ``all_gather``, which gloo supports as well as NCCL. A checkpoint save ends with
    one, and a rank may leave right after it: it returns only once gloo has let go of its tensors
    (``dsp_plugin.comm.collectives.released``; else a busy machine aborts that rank at exit).
    """
    mine = row.detach().clone(memory_format=torch.contiguous_format)   # only gloo and this call hold it
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows)
    refs = [weakref.ref(t) for t in (mine, *rows)]
    del mine, rows
    released(group, refs)
    return table
