"""What a training framework keeps per GPU besides activations: parameters, gradients, optimizer states, buffers.

DeepSpeed ZeRO (bf16 weights, torch AdamW: an fp32 master copy plus two fp32 moments, and a
scalar step per master tensor), over the ZeRO group of ``D = DP x DSP`` ranks (DeepSpeed's
``seq_data_parallel_group``, which ``dsp_plugin.deepspeed`` makes the DP x DSP group), with
DeepSpeed 0.19.8's defaults and padding (``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``partition_parameters.py``, ``config.py``):

=====  ==========================================  =====================  ========================================
stage  parameters (bf16)                           gradients (bf16)       optimizer (fp32 master, m, v)
=====  ==========================================  =====================  ========================================
0      every parameter                             every parameter        every parameter (nothing sharded)
1      one flat buffer of all, padded to 2D        the parameters in the  flat / D
                                                   rank's flat / D, whole
2      the same                                    the same               flat / D
3      ceil(numel / D) of each; whole if numel     ceil(numel / D) each   ceil(numel / D) each
       <= 1e5 (``param_persistence_threshold``)
=====  ==========================================  =====================  ========================================

Gradients at stages 1-2 (contiguous gradients, DeepSpeed's default): each goes into the reduce bucket
as it is produced; after the bucket's reduction the gradients of the parameters that reach into this
rank's partition are copied out whole into one buffer (``copy_grads_in_partition``), at stage 1 as at
stage 2; the others are left in the bucket.

Buffers: stage 1-2 reduce into a bucket of ``reduce_bucket_size`` (5e8) elements of the gradients'
dtype (bf16), allocated whole at the start of every backward whatever the model's size
(``setup_buckets``; contiguous gradients are DeepSpeed's default); stage 3 allocates its bucket
once, in the dtype the gradients are reduced in: fp32 under sequence parallelism (DeepSpeed's
``seq_parallel_communication_data_type`` default, taken when the sequence-parallel size is above 1),
else bf16; and gathers the parameters it does not keep whole: the module being computed plus up to
``prefetch_bucket_size`` (5e7) elements prefetched, never more than there are. The step makes an
fp32 copy of this rank's gradient partition (``step_transient``). ``tests/test_dryrun.py`` holds
every figure against a real engine at stages 1-3 (gradients: the most DeepSpeed holds at once
outside its bucket).
Stage 0 is the ZeRO paper's baseline (no DeepSpeed wrapper; DeepSpeed's own bf16 stage 0 keeps
bf16 moments instead).

The gradient reduction and parameter gathering of each stage are listed as modelled collectives
(bytes per rank in ``dsp_plugin.accounting``'s convention): the fake tier does not run DeepSpeed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

__all__ = ["Collective", "FrameworkState", "deepspeed_state"]

BF16, FP32 = 2, 4
REDUCE_BUCKET = int(5e8)
PREFETCH_BUCKET = int(5e7)
PERSISTENCE_THRESHOLD = int(1e5)
SUB_GROUP = int(1e9)
ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: the flat buffer is padded to 2 * D elements


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step on this rank (``count`` calls, bytes summed over them)."""

    op: str
    phase: str
    group: str           # "dsp", "dp", "dp x dsp", "tp", ...
    group_size: int
    count: int
    bytes_sent: int
    where: str           # the module (pattern) that issued it, or what models it
    modelled: bool = False
    kind: str = "data parallel"  # "sequence": the model's own (DSP, head switch, TP); "data parallel": the framework's


@dataclass
class FrameworkState:
    params: int
    grads: int
    optimizer: int
    buffers: int
    step_transient: int
    describe: str
    collectives: list[Collective] = field(default_factory=list)


def deepspeed_state(numels: list[int], *, zero: int, group_size: int, largest_module: int,
                    recompute: bool, sequence_parallel: bool = False) -> FrameworkState:
    """ZeRO-``zero`` state of one rank for trainable parameters of ``numels`` elements, over ``group_size`` ranks.

    ``largest_module``: elements of the largest module DeepSpeed gathers at once (stage 3: its parameters above
    ``PERSISTENCE_THRESHOLD``); ``sequence_parallel``: DSP over more than one rank (stage 3 reduces in fp32).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {zero}: expected 0, 1, 2 or 3")
    d, total = group_size, sum(numels)
    name = "dp x dsp"
    out: list[Collective] = []
    if zero == 0:
        if d > 1:
            out.append(Collective("all_reduce", "backward", name, d, 1, 2 * total * BF16 * (d - 1) // d,
                                  "gradients (modelled: one all-reduce of every bf16 gradient)", True))
        return FrameworkState(total * BF16, total * BF16, total * (3 * FP32) + FP32 * len(numels), 0, 0,
                              f"no ZeRO: {total:,} parameters whole on every rank", out)
    if zero in (1, 2):
        alignment = ALIGNMENT_FACTOR * d
        flat = math.ceil(total / alignment) * alignment
        part = flat // d
        # the gradients of this rank's partition (rank 0's: the first ``part`` elements of the flat buffer), each
        # parameter reaching into it whole (``copy_grads_in_partition``); the others stay in the bucket
        starts = itertools.accumulate([0, *numels[:-1]])
        grads = sum(n for start, n in zip(starts, numels) if start < part) * BF16
        buffers = REDUCE_BUCKET * BF16  # the whole bucket, ZeRO-1's too, however small the model
        if d > 1:
            out.append(Collective("reduce_scatter", "backward", name, d, 1, flat * BF16 * (d - 1) // d,
                                  "gradients (modelled: bf16 flat, reduced to this rank's partition)", True))
            out.append(Collective("all_gather", "step", name, d, 1, part * BF16 * (d - 1),
                                  "parameters after the step (modelled: bf16 partitions)", True))
        return FrameworkState(flat * BF16, grads, part * 3 * FP32 + FP32, buffers, part * FP32,
                              f"ZeRO-{zero}: flat {flat:,} elements (padded to {alignment}), {part:,} a rank", out)
    parts = [math.ceil(n / d) for n in numels]
    persistent = sum(n for n in numels if n <= PERSISTENCE_THRESHOLD)
    gathered = sum(p for n, p in zip(numels, parts) if n > PERSISTENCE_THRESHOLD)
    part = sum(parts)
    sub_groups = max(1, math.ceil(part / SUB_GROUP))
    gathered_at_once = min(largest_module + PREFETCH_BUCKET, sum(n for n in numels if n > PERSISTENCE_THRESHOLD))
    buffers = gathered_at_once * BF16 + REDUCE_BUCKET * (FP32 if sequence_parallel else BF16)
    if d > 1:
        gathers = 3 if recompute else 2  # forward, backward (and the recomputed forward)
        out.append(Collective("all_gather", "forward+backward", name, d, gathers,
                              gathers * gathered * BF16 * (d - 1),
                              f"parameters gathered per module ({gathers}x a step; modelled)", True))
        out.append(Collective("reduce_scatter", "backward", name, d, 1, part * BF16 * (d - 1),
                              "gradients (modelled: bf16, per parameter partition)", True))
    return FrameworkState((part + persistent) * BF16, part * BF16, part * 2 * FP32 + part * FP32 + FP32 * sub_groups,
                          buffers, part * FP32,
                          f"ZeRO-3: {part:,} elements a rank ({persistent:,} more kept whole: parameters of <= "
                          f"{PERSISTENCE_THRESHOLD:,} elements)", out)
