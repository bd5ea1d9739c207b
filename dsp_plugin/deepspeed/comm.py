"""The one collective the DeepSpeed integration issues itself, besides the guard's.

Besides ``dsp_plugin.comm`` and ``dsp_plugin.baselines.comm``, this is the only
module allowed to call torch.distributed collectives (``tests/test_comm_choke_point.py``),
so the integration's own traffic is easy to audit: a tiny all-gather twice per
checkpoint save (``checkpoint.py``: the save id, then "every manifest is
written"). The first-forward guard exchanges through ``dsp_plugin.comm.exchange_words``
(the primitives' check format). Everything else is DeepSpeed's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_rows"]


def all_gather_rows(row: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D ``row`` (same length on all ranks), stacked in group-rank order: ``[n, len]``.

    The list form of ``all_gather``, which gloo supports as well as NCCL.
    """
    row = row.contiguous()
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)
