"""The DSP primitives, the overlapped switch and the gradient reduction: every collective DSP issues.

By role (each module imports only those above it)::

    collectives.py        the raw torch.distributed calls; the ONLY module of the library that makes one,
                          besides the baselines' and the DeepSpeed guard's own comm.py
                          (tests/test_comm_choke_point.py)
    group_resolution.py   group=None -> the DSP group of the installed topology; the no-topology rule
    agree.py              a call's argument checks, and the cross-rank agreement before its collective
    reduce_scatter.py     the all_gather and its adjoint, the reduce_scatter: ``gather``'s data movement, and
                          ``gather(partial_grad=True)``'s autograd Functions (each the other's backward)
    primitives.py         split, gather, dynamic_switch: the data movement and the autograd Functions
    overlap.py            switch_apply: a chunk's all-to-all in flight while the previous chunk computes
    reduction.py          reduce_gradients and the agreement on the parameter list
    replicate.py          replicate_grad: a replicated input's full gradient on every rank (sum in backward)

``from dsp_plugin.comm import <name>`` keeps working for every public name below.
"""

from __future__ import annotations

from dsp_plugin.comm.agree import agree_inputs, exchange_words, raise_together
from dsp_plugin.comm.collectives import all_reduce_mean, meet_and_close
from dsp_plugin.comm.group_resolution import NoProcessGroupError, NoTopologyError, group_rank, group_size
from dsp_plugin.comm.group_resolution import no_topology_message as no_topology_message  # public, not in __all__
from dsp_plugin.comm.overlap import switch_apply
from dsp_plugin.comm.primitives import count_sharded_call, dynamic_switch, gather, sharded_calls, split
from dsp_plugin.comm.reduction import reduce_gradients
from dsp_plugin.comm.replicate import replicate_grad
from dsp_plugin.packing import chunk_sizes

__all__ = [
    "NoProcessGroupError",
    "NoTopologyError",
    "agree_inputs",
    "all_reduce_mean",
    "meet_and_close",
    "chunk_sizes",
    "count_sharded_call",
    "dynamic_switch",
    "exchange_words",
    "gather",
    "group_rank",
    "group_size",
    "raise_together",
    "reduce_gradients",
    "replicate_grad",
    "sharded_calls",
    "split",
    "switch_apply",
]
