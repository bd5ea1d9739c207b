"""Alpha-beta cost model of one step of the paper's STDiT on H100 clusters, method by method.

Why a model: the paper's results come from 128 H100s; this repo's CI has two CPU
cores. The model turns the communication each method REALLY issued in the
paper's harness (``params.py`` cites the lines) into time, so the paper's
numbers can be reproduced and the share of each cause made visible.

Per layer and GPU, with ``X = B*T*S*C*2 / N`` (bf16 bytes of one activation shard):

==============  ==========================================================  ======================
method          forward collectives per layer                               compute
==============  ==========================================================  ======================
dsp             2 all-to-all of X (temporal <-> spatial switch)              all local
ulysses         temporal block: 1 packed q/k/v all-to-all (3X) + out (X)     same as dsp
ulysses_paper   spatial q,k,v,o + temporal q,k,v,o + cross q,o: 10 x X,     same as dsp
                plus the cross-attention's text k, v (tiny), 12 calls
megatron_sp     3 attentions x (all-gather + reduce-scatter) of X*N,        same as dsp (MLP
                heads split (harness: the MLP stays replicated, no comm)     replicated on the shard)
ring            harness: frames split on W, ring attention in the spatial   spatial attention over
                block only, N-1 hops of K+V (2X), overlapped with compute    N x S keys (harness)
==============  ==========================================================  ======================

Cost of one collective: ``alpha + bytes / bandwidth``; an all-to-all sends its
off-node share (N-8)/(N-1) over InfiniBand while the on-node share moves over
NVLink; ring collectives are gated by their slowest hop. Each all-to-all also
costs two copies of X (``COPIES_PER_ALL_TO_ALL``) at the HBM copy rate, for
DSP too. Compute: FLOPs / (peak x utilization). With activation checkpointing
every forward collective runs three times a step and the forward compute twice.
``Factors`` switches each of these effects off, for the ladder in ``ladder.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dsp_plugin.bench import params
from dsp_plugin.bench.params import Hardware, ModelSize

METHODS = ("dsp", "ulysses_paper", "ulysses", "megatron_sp", "ring")
HEAD_LIMITED = ("ulysses_paper", "ulysses", "megatron_sp")


@dataclass(frozen=True)
class Factors:
    """Which real-world effects the model charges (all on = the paper's harness)."""

    recompute: bool = params.ACTIVATION_CHECKPOINTING
    copies: bool = True
    spatial_a2a: bool = True       # ulysses_paper: q/k/v/o all-to-alls in the spatial block too
    cross_a2a: bool = True         # ulysses_paper: q/o (and text k/v) all-to-alls in the cross-attention
    placement: bool = True         # SP > 8 spans nodes (contiguous ranks, 8 GPUs a node); off: all NVLink
    backward: bool = True          # off: inference, one forward pass (Figure 8)


HARNESS = Factors()
IDEAL = Factors(recompute=False, copies=False, spatial_a2a=False, cross_a2a=False, placement=False)
INFERENCE = replace(HARNESS, recompute=False, backward=False)


@dataclass(frozen=True)
class Prediction:
    """Predicted step (seconds, per GPU) of one method in one setting."""

    method: str
    sp: int
    feasible: bool
    reason: str = ""
    compute_s: float = 0.0
    comm_s: float = 0.0            # SP collectives on the critical path (links only)
    copy_s: float = 0.0            # pack / unpack copies around the all-to-alls
    dp_sync_s: float = 0.0
    useful_flops: float = 0.0
    calls_per_layer: int = 0       # forward collective calls per layer
    bytes_per_layer: float = 0.0   # forward bytes one GPU sends per layer
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.copy_s + self.dp_sync_s

    @property
    def flops_per_gpu(self) -> float:
        """Achieved model FLOP/s per GPU (recompute and the harness ring's extra attention not useful)."""
        return self.useful_flops / self.step_s if self.feasible else 0.0


def _spans_nodes(n: int, hw: Hardware, f: Factors) -> bool:
    return f.placement and n > hw.gpus_per_node


def all_to_all_s(held: float, n: int, hw: Hardware, f: Factors = HARNESS) -> float:
    """One all-to-all of ``held`` bytes per GPU: (N-1)/N of it leaves, off-node share over IB."""
    if n <= 1 or held <= 0:
        return 0.0
    sent = held * (n - 1) / n
    if not _spans_nodes(n, hw, f):
        return hw.nvlink_alpha_s + sent / hw.nvlink_bytes_per_s
    off = sent * (n - hw.gpus_per_node) / (n - 1)
    return hw.ib_alpha_s + max(off / hw.ib_bytes_per_s, (sent - off) / hw.nvlink_bytes_per_s)


def ring_collective_s(sent: float, n: int, hw: Hardware, *, inter_node: bool) -> float:
    """All-gather / reduce-scatter as an (n-1)-step ring sending ``sent`` bytes, gated by its slowest link."""
    if n <= 1 or sent <= 0:
        return 0.0
    alpha, bw = ((hw.ib_alpha_s, hw.ib_bytes_per_s) if inter_node else (hw.nvlink_alpha_s, hw.nvlink_bytes_per_s))
    return (n - 1) * alpha + sent / bw


def layer_flops(tokens: float, temporal: int, model: ModelSize, *, spatial_keys: float) -> float:
    """Forward FLOPs of one STDiT layer on ``tokens`` tokens (linears, three attentions, text k/v)."""
    c = model.hidden
    linears = 2 * params.LINEAR_MATRICES_PER_LAYER * c * c * tokens
    attention = 4 * tokens * c * (spatial_keys + temporal + model.text_tokens)
    return linears + attention


def parameter_count(model: ModelSize) -> float:
    return model.layers * params.PARAMETER_MATRICES_PER_LAYER * model.hidden ** 2


def feasibility(method: str, model: ModelSize, temporal: int, sp: int) -> str:
    """'' if ``method`` can run, else why not (the reason starts with a short tag)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if method in HEAD_LIMITED and (sp > model.heads or model.heads % sp):
        return f"head limit: {model.heads} heads on {sp} ranks"
    if temporal < sp:
        return f"T < N: T={temporal} frames on {sp} ranks"
    return ""


def predict(method: str, model: ModelSize, *, batch: int, temporal: int, sp: int, dp: int = 1,
            spatial: int = params.SPATIAL, hw: Hardware = params.H100, factors: Factors = HARNESS) -> Prediction:
    """One training step (or, with ``factors.backward`` off, one forward) of ``method``."""
    why = feasibility(method, model, temporal, sp)
    if why:
        return Prediction(method, sp, False, why)
    f, n = factors, sp
    tokens = batch * temporal * spatial
    held = tokens * model.hidden * params.BYTES_PER_ELEMENT / n        # X: one activation shard
    text = batch * model.text_tokens * model.hidden * params.BYTES_PER_ELEMENT
    fwd_runs = (2 if f.recompute else 1) if f.backward else 1            # executions of a forward collective
    runs = fwd_runs + (1 if f.backward else 0)                           # plus its backward inverse
    fwd_passes = (2 if f.recompute else 1) if f.backward else 1
    compute_passes = fwd_passes + (2 if f.backward else 0)               # backward = 2 x forward FLOPs

    # forward all-to-alls of one layer, as the bytes each GPU holds per call
    a2a: list[float] = []
    if method == "dsp":
        a2a = [held, held]
    elif method == "ulysses":
        a2a = [3 * held, held]
    elif method == "ulysses_paper":
        a2a = [held] * 4
        if f.spatial_a2a:
            a2a += [held] * 4
        if f.cross_a2a:
            a2a += [held, held, text, text]
    a2a_s = sum(all_to_all_s(x, n, hw, f) for x in a2a)
    copy_s = params.COPIES_PER_ALL_TO_ALL * sum(a2a) / hw.copy_bytes_per_s if f.copies and n > 1 else 0.0

    spatial_keys = float(spatial)
    other_s = 0.0
    sent = sum(x * (n - 1) / n for x in a2a)
    calls = len(a2a)
    rate = hw.flops_per_s
    if method == "megatron_sp":
        per = held * (n - 1)                                             # all-gather/reduce-scatter of X*N
        other_s = 6 * ring_collective_s(per, n, hw, inter_node=_spans_nodes(n, hw, f))
        sent, calls = 6 * per, 6
    elif method == "ring" and n > 1:
        spatial_keys = float(spatial) * n                                # harness: N x S keys per query
        chunk = 4 * (tokens / n) * spatial * model.hidden / rate         # one hop's chunk of attention
        hop = (lambda nbytes: (hw.ib_alpha_s + nbytes / hw.ib_bytes_per_s) if _spans_nodes(n, hw, f)
               else (hw.nvlink_alpha_s + nbytes / hw.nvlink_bytes_per_s))
        fwd_hop, bwd_hop = hop(2 * held), hop(4 * held)
        if params.RING_OVERLAP:
            fwd_hop, bwd_hop = max(0.0, fwd_hop - chunk), max(0.0, bwd_hop - 2 * chunk)
        per_layer_ring = (n - 1) * (fwd_runs * fwd_hop + (bwd_hop if f.backward else 0.0))
        sent, calls = 2 * held * (n - 1), n - 1
    layer_fwd = layer_flops(tokens, temporal, model, spatial_keys=spatial_keys) / n
    compute = model.layers * compute_passes * layer_fwd / rate
    useful = model.layers * (3 if f.backward else 1) * layer_flops(tokens, temporal, model,
                                                                  spatial_keys=spatial) / n
    comm = model.layers * runs * (a2a_s + other_s)
    if method == "ring":
        comm = model.layers * per_layer_ring if n > 1 else 0.0
    copies = model.layers * runs * copy_s

    # ZeRO-2 (every method in the harness: LowLevelZeroPlugin stage 2): reduce-scatter bf16 grads,
    # all-gather bf16 params over DP, not overlapped; DP ranks are strided, so over IB once dp*sp > 8.
    dp_sync = 0.0
    if f.backward and dp > 1:
        dp_bytes = 2 * parameter_count(model) * params.BYTES_PER_ELEMENT * (dp - 1) / dp
        dp_sync = ring_collective_s(dp_bytes, dp, hw, inter_node=dp * sp > hw.gpus_per_node)
    return Prediction(method, sp, True, "", compute, comm, copies, dp_sync, useful, calls, sent,
                      {"compute": compute, "links": comm, "copies": copies, "dp": dp_sync})
