"""dsp_plugin: Dynamic Sequence Parallelism for multi-dimensional transformers.

The paper's API (appendix A.4)::

    from dsp_plugin import dsp_dataloader, split, gather, dynamic_switch

``import dsp_plugin`` needs torch only; the Megatron and DeepSpeed integrations
live in ``dsp_plugin.megatron`` and ``dsp_plugin.deepspeed`` and import their
frameworks lazily.
"""

from __future__ import annotations

from dsp_plugin.comm import dynamic_switch, gather, reduce_gradients, replicate_grad, split
from dsp_plugin.data import dsp_dataloader
from dsp_plugin.head_switch import from_heads, to_heads
from dsp_plugin.plan import parallelize
from dsp_plugin.topology import Topology, get_topology, set_topology

__all__ = [
    "Topology",
    "dsp_dataloader",
    "dynamic_switch",
    "from_heads",
    "gather",
    "get_topology",
    "parallelize",
    "reduce_gradients",
    "replicate_grad",
    "set_topology",
    "split",
    "to_heads",
]

__version__ = "0.1.0"
