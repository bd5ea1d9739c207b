"""The ``mpu`` DeepSpeed queries for its process groups, backed by a DSP ``Topology``.

DeepSpeed has no registry of parallel groups; it duck-types the ``mpu`` object
passed to ``deepspeed.initialize`` (``deepspeed/utils/groups.py``:
``hasattr(mpu, "get_sequence_data_parallel_group")``). What each getter means
to DeepSpeed, and what we answer:

=====================================  ===============  ==========================================
getter family                          DSP group        DeepSpeed uses it for
=====================================  ===============  ==========================================
``get_sequence_parallel_*``            DSP              ``sequence_parallel_size``: the SP factor
                                                        in its gradient averaging
``get_sequence_data_parallel_*``       DP x DSP         ZeRO partitioning, gradient reduction,
                                                        the initial broadcast, checkpoint ranks
``get_data_parallel_*``                DP               batch-size arithmetic, data sampler
``get_model_parallel_*``               TP x PP (=1)     norm/overflow reductions, ckpt names
``get_tensor_model_parallel_*``        TP (=1)          tensor-parallel bookkeeping
``get_pipeline_model_parallel_*``      PP (=1)          pipeline bookkeeping
=====================================  ===============  ==========================================

The object must NOT define ``initialize_sequence_parallel``: DeepSpeed treats an
mpu with that attribute as its own Ulysses state and then ignores the DP getters.
"""

from __future__ import annotations

import torch.distributed as dist

from dsp_plugin.topology import Topology

__all__ = ["DeepSpeedMPU"]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class DeepSpeedMPU:
    """Answers DeepSpeed's group queries from ``topology`` (built with tp=1, pp=1 here)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def __repr__(self) -> str:
        return f"DeepSpeedMPU({self.topology.describe()})"

    # --- DSP: the ranks that share one sample -------------------------------------------
    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.dsp_group

    def get_sequence_parallel_world_size(self) -> int:
        return _size(self.topology.dsp_group)

    def get_sequence_parallel_rank(self) -> int:
        return _rank(self.topology.dsp_group)

    # --- DP x DSP: where gradients are reduced and ZeRO partitions ------------------------
    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.dp_dsp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return _size(self.topology.dp_dsp_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return _rank(self.topology.dp_dsp_group)

    # --- DP: ranks that see different samples -----------------------------------------------
    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.dp_group

    def get_data_parallel_world_size(self) -> int:
        return _size(self.topology.dp_group)

    def get_data_parallel_rank(self) -> int:
        return _rank(self.topology.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        for ranks in self.topology.layout.get("dp", []):
            if self.topology.rank in ranks:
                return list(ranks)
        return [self.topology.rank]

    # --- model parallel (TP x PP), tensor parallel, pipeline: size 1 with DSP alone ----------
    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return _size(self.topology.model_parallel_group)

    def get_model_parallel_rank(self) -> int:
        return _rank(self.topology.model_parallel_group)

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return _size(self.topology.tp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return _rank(self.topology.tp_group)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (TP ranks are innermost)."""
        return self.topology.rank - self.get_tensor_model_parallel_rank()

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.topology.pp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return _size(self.topology.pp_group)

    def get_pipeline_model_parallel_rank(self) -> int:
        return _rank(self.topology.pp_group)
