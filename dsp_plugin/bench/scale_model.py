"""Alpha-beta cost model of one training step of the paper's 2D-Transformer on H100 clusters.

Why a model: the paper's results come from 128 H100s; this repo's CI has two CPU
cores. The model turns the communication pattern each method really issues (the
same per-layer collectives the measured CPU bench counts) into time, with the
hardware numbers of ``params.py``, so the paper's claims can be checked for
plausibility and the places where they cannot be reproduced by bandwidth alone
are visible.

Cost of one collective, per GPU: ``alpha + bytes / bandwidth``, where the
bandwidth is NVLink when the group sits in one node of 8 and InfiniBand when it
spans nodes (ring-style collectives are gated by their slowest hop; an
all-to-all sends its off-node share over IB while the on-node share moves over
NVLink concurrently). Compute: FLOPs / (peak * utilization).

Per layer (two 1D blocks), M_loc = activation bytes per GPU = B*T*S*D*2/N:

=============  ========================================  ====================
method         forward collectives                       backward
=============  ========================================  ====================
dsp            2 all-to-all, M_loc (N-1)/N each            same, reversed
ulysses        4 all-to-all (q, k, v, o) in temporal blk   same, reversed
ring           N-1 hops of K+V (2 M_loc) in temporal blk   N-1 hops of K,V,dK,dV
megatron_sp    per block 2 all-gather + 2 reduce-scatter,  RS <-> AG
               M (N-1)/N each; 8 per layer
=============  ========================================  ====================

With activation checkpointing the forward (compute and collectives) runs twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsp_plugin.bench import params
from dsp_plugin.bench.config import METHODS
from dsp_plugin.bench.params import Hardware, ModelSize


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one method in one setting (times in seconds, per GPU)."""

    method: str
    sp: int
    feasible: bool
    reason: str
    compute_s: float = 0.0
    comm_s: float = 0.0
    dp_sync_s: float = 0.0
    memory_bytes: float = 0.0
    useful_flops: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.dp_sync_s

    @property
    def flops_per_gpu(self) -> float:
        """Achieved model FLOP/s per GPU (recompute not counted as useful)."""
        return self.useful_flops / self.step_s if self.feasible else 0.0


def _spans_nodes(n: int, hw: Hardware) -> bool:
    return n > hw.gpus_per_node


def all_to_all_s(bytes_sent: float, n: int, hw: Hardware) -> float:
    """All-to-all: on-node share over NVLink and off-node share over IB, concurrently."""
    if n <= 1 or bytes_sent <= 0:
        return 0.0
    if not _spans_nodes(n, hw):
        return hw.nvlink_alpha_s + bytes_sent / hw.nvlink_bytes_per_s
    off = bytes_sent * (n - hw.gpus_per_node) / (n - 1)
    on = bytes_sent - off
    return hw.ib_alpha_s + max(off / hw.ib_bytes_per_s, on / hw.nvlink_bytes_per_s)


def ring_collective_s(bytes_sent: float, n: int, hw: Hardware, *, inter_node: bool | None = None) -> float:
    """All-gather / reduce-scatter as an (n-1)-step ring, gated by its slowest link."""
    if n <= 1 or bytes_sent <= 0:
        return 0.0
    inter_node = _spans_nodes(n, hw) if inter_node is None else inter_node
    alpha, bw = ((hw.ib_alpha_s, hw.ib_bytes_per_s) if inter_node
                 else (hw.nvlink_alpha_s, hw.nvlink_bytes_per_s))
    return (n - 1) * alpha + bytes_sent / bw


def hop_s(bytes_sent: float, n: int, hw: Hardware) -> float:
    """One ring-attention hop (send to the next rank); the node-crossing hop gates the step."""
    if n <= 1:
        return 0.0
    alpha, bw = ((hw.ib_alpha_s, hw.ib_bytes_per_s) if _spans_nodes(n, hw)
                 else (hw.nvlink_alpha_s, hw.nvlink_bytes_per_s))
    return alpha + bytes_sent / bw


def block_flops(tokens: float, attend_len: int, model: ModelSize) -> float:
    """Forward FLOPs of one 1D block: qkv+proj+MLP matmuls plus QK^T and AV."""
    d = model.hidden
    matmul = 2 * (4 + 2 * model.mlp_ratio) * d * d * tokens
    attention = 4 * tokens * attend_len * d
    return matmul + attention


def parameter_count(model: ModelSize) -> float:
    """Block parameters (the embedders are negligible at these sizes)."""
    d = model.hidden
    return model.layers * 2 * (4 + 2 * model.mlp_ratio) * d * d


def predict(method: str, model: ModelSize, *, batch: int, temporal: int, sp: int, dp: int = 1,
            spatial: int = params.SPATIAL, hw: Hardware = params.H100) -> Prediction:
    """One training step of ``method`` with ``batch`` samples per SP group on ``sp`` GPUs."""
    if method in ("ulysses", "megatron_sp") and (sp > model.heads or model.heads % sp):
        return Prediction(method, sp, False, f"head limit: {model.heads} heads on {sp} ranks")
    if method != "megatron_sp" and temporal < sp:
        return Prediction(method, sp, False, f"T={temporal} < N={sp}")
    nbytes = params.BYTES_PER_ELEMENT
    tokens = batch * temporal * spatial
    act = tokens * model.hidden * nbytes          # M: one layer's activation, whole SP group
    act_loc = act / sp                            # M_loc
    fwd_passes = 2 if params.ACTIVATION_CHECKPOINTING else 1

    layer_fwd = block_flops(tokens, temporal, model) + block_flops(tokens, spatial, model)
    useful = model.layers * 3 * layer_fwd / sp
    executed = model.layers * (fwd_passes + 2) * layer_fwd / sp
    rate = hw.peak_flops * hw.utilization
    compute = executed / rate

    share = (sp - 1) / sp
    per_layer = 0.0
    if method == "dsp":
        per_layer = (fwd_passes + 1) * 2 * all_to_all_s(act_loc * share, sp, hw)
    elif method == "ulysses":
        per_layer = (fwd_passes + 1) * 4 * all_to_all_s(act_loc * share, sp, hw)
    elif method == "megatron_sp":
        per_layer = (fwd_passes + 1) * 8 * ring_collective_s(act * share, sp, hw)
    elif method == "ring":
        # per hop: temporal attention of one K/V chunk against the local queries
        chunk_attention = 4 * (tokens / sp) * (temporal / sp) * model.hidden / rate
        fwd_hop, bwd_hop = hop_s(2 * act_loc, sp, hw), hop_s(4 * act_loc, sp, hw)
        if params.RING_OVERLAP:
            fwd_extra = max(0.0, fwd_hop - chunk_attention)
            bwd_extra = max(0.0, bwd_hop - 2 * chunk_attention)
        else:
            fwd_extra, bwd_extra = fwd_hop, bwd_hop
        per_layer = (sp - 1) * (fwd_passes * fwd_extra + bwd_extra)
    else:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    comm = model.layers * per_layer

    # Data parallelism: ZeRO-2 reduce-scatter of grads + all-gather of params (bf16) over DP;
    # Megatron-SP (no ZeRO in the paper) all-reduces its 1/N slice of the grads instead.
    p = parameter_count(model)
    dp_bytes = 2 * p * nbytes * (dp - 1) / dp / (sp if method == "megatron_sp" else 1)
    dp_sync = ring_collective_s(dp_bytes, dp, hw, inter_node=dp * sp > hw.gpus_per_node)

    # Memory (rough, informational): checkpointed block inputs + one block's working set +
    # params/grads/optimizer.
    layers_inputs = model.layers * 2 * act_loc
    working = params.WORKING_SET_ELEMENTS_PER_TOKEN_DIM * act_loc
    if method == "megatron_sp":
        working += 2 * act                         # gathered inputs of attention and MLP
        states = p * 18 / sp                       # TP-sharded bf16 params + fp32 grads/Adam
    else:
        states = p * (2 + 16 / max(dp, 1))         # ZeRO-2: params whole, grads+Adam sharded
    memory = layers_inputs + working + states
    # The paper ran every setting it lists, so memory is reported, not used to veto a point.
    note = f"est. {memory / 1e9:.0f} GB > HBM" if memory > hw.hbm_bytes else ""
    return Prediction(method, sp, True, note, compute, comm, dp_sync, memory, useful)
