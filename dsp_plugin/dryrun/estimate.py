"""Step time from the dry run's FLOPs and collectives, priced by the project's scale model.

Compute: the step's FLOPs (``FlopCounterMode``: forward, backward and any recompute) at the
hardware's achieved rate (``Hardware.flops_per_s``: peak x utilization, or a calibrated layer
rate, ``dsp_plugin.bench.calibration``). Each collective: ``scale_model.all_to_all_s`` (NVLink
inside a node of 8, the off-node share over InfiniBand) plus two HBM copies of the data
(``params.COPIES_PER_ALL_TO_ALL``, DSP's pack and unpack), ``ring_collective_s`` for all-gathers
and reduce-scatters, two ring phases for an all-reduce. Nothing overlaps (as the scale model
assumes of the paper's harness): an upper bound where a framework overlaps the gradient
reduction with the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsp_plugin.bench import params
from dsp_plugin.bench.params import Hardware
from dsp_plugin.bench.scale_model import HARNESS, all_to_all_s, ring_collective_s
from dsp_plugin.dryrun.state import Collective

__all__ = ["StepEstimate", "estimate"]


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float
    sequence_s: float     # the model's own collectives (DSP, head switch, TP), links
    copies_s: float       # pack / unpack copies around the all-to-alls
    data_parallel_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.sequence_s + self.copies_s + self.data_parallel_s


def _spans_nodes(c: Collective, tp: int, world: int, hw: Hardware) -> bool:
    if c.group.startswith(("dsp", "tp")):
        return tp * c.group_size > hw.gpus_per_node if c.group.startswith("dsp") else c.group_size > hw.gpus_per_node
    return world > hw.gpus_per_node  # DP groups are strided over TP x DSP: across nodes once the job is


def estimate(flops: float, collectives: list[Collective], *, tp: int, world: int,
             hw: Hardware = params.H100) -> StepEstimate:
    """The step time of one rank: compute, the model's collectives, their copies, the data-parallel traffic."""
    sequence = copies = dp = 0.0
    for c in collectives:
        n = c.group_size
        if n <= 1 or c.count == 0:
            continue
        per_call = c.bytes_sent / c.count
        inter = _spans_nodes(c, tp, world, hw)
        if c.op == "all_to_all":
            held = per_call * n / (n - 1)
            t = c.count * all_to_all_s(held, n, hw, HARNESS)  # across nodes when the group outgrows one
            copies += c.count * params.COPIES_PER_ALL_TO_ALL * held / hw.copy_bytes_per_s
        else:  # all-gather, reduce-scatter; an all-reduce's bytes already count both ring phases
            t = c.count * ring_collective_s(per_call, n, hw, inter_node=inter)
        if c.kind == "sequence":
            sequence += t
        else:
            dp += t
    return StepEstimate(flops / hw.flops_per_s, sequence, copies, dp)
