"""Step time of a full-3D-attention video DiT (Wan 2.1) on H100 clusters, per sequence-parallel method.

The STDiT scale model (``scale_model.py``) prices the paper's factorized model. A full-3D model
attends every token to every token, so no sequence dim can stay sharded through attention: DSP's
plan sends q, k, v to the head shard and the output back (the head switch), as Ulysses and
Megatron's context parallelism with all-to-alls do; Megatron's ``p2p`` context parallelism instead
passes K and V around a ring. Per layer and GPU, with ``X = tokens/N * C * 2 / TP`` bytes (one
activation shard, bf16):

============  =======================================================  ===========================
method        forward collectives per layer                             under recompute
============  =======================================================  ===========================
dsp           the head switch: one packed q/k/v all-to-all (3X), one    not replayed: the plan keeps
              for the output (X); whole frames per rank (N <= frames;   each output for the recompute
              the rank with ceil(F/N) frames sets the pace), uneven     (``plan/recompute.py``)
              heads allowed (the rank with ceil(H/N) heads sets the
              attention time)
head_switch   the same switches on an even split of the flat tokens (a plan   not replayed
              like CogVideoX's: ``Split("hidden_states", "B L D")``), no
              frame limit
ulysses       DeepSpeed's DistributedAttention: q, k, v, out: 4 calls   replayed
              of X; needs H % N == 0
cp_a2a        Megatron CP ``a2a``: the same 4 calls of X; H % N == 0     replayed
cp_p2p        Megatron CP ``p2p``: N - 1 ring hops of K and V (2X), each  replayed
              overlapped with the attention of the chunk it brings
============  =======================================================  ===========================

TP (with Megatron's sequence parallelism) adds an all-gather and a reduce-scatter of X around the
self-attention, the cross-attention and the MLP (6 a layer forward, 6 backward). The data-parallel
gradient reduce-scatter (fp32) and parameter all-gather (bf16) of the distributed optimizer run
over DP x SP, not overlapped. Compute: FLOPs at ``Hardware.flops_per_s``; "model FLOPs" are 3x the
forward (no recompute, no head imbalance), the convention of a TFLOP/s-per-GPU figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsp_plugin.bench import params
from dsp_plugin.bench.params import Hardware

__all__ = ["METHODS", "WAN_14B", "Full3DModel", "Full3DPrediction", "predict"]

METHODS = ("dsp", "head_switch", "ulysses", "cp_a2a", "cp_p2p")


@dataclass(frozen=True)
class Full3DModel:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    text_tokens: int
    parameters: float


# Wan-AI/Wan2.1-T2V-14B (dsp_plugin/dryrun/configs/wan2.1-14b.json); parameters as the dry run counts them
WAN_14B = Full3DModel("Wan 2.1 14B", layers=40, hidden=5120, heads=40, ffn=13824, text_tokens=512,
                      parameters=14.288e9)


@dataclass(frozen=True)
class Full3DPrediction:
    method: str
    feasible: bool
    reason: str = ""
    compute_s: float = 0.0
    sequence_s: float = 0.0
    tp_s: float = 0.0
    copies_s: float = 0.0
    dp_s: float = 0.0
    model_flops: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.sequence_s + self.tp_s + self.copies_s + self.dp_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / 1e12 if self.feasible else 0.0


def _link_s(sent: float, group: int, stride: int, hw: Hardware, *, calls: int = 1) -> float:
    """``sent`` bytes a GPU sends in a collective over ``group`` ranks ``stride`` apart (TP innermost):
    NVLink inside a node, the off-node share over InfiniBand."""
    if group <= 1 or sent <= 0:
        return 0.0
    if group * stride <= hw.gpus_per_node:
        return calls * hw.nvlink_alpha_s + sent / hw.nvlink_bytes_per_s
    on_node = max(1, hw.gpus_per_node // stride)
    off = sent * (group - on_node) / (group - 1)
    return calls * hw.ib_alpha_s + max(off / hw.ib_bytes_per_s, (sent - off) / hw.nvlink_bytes_per_s)


def feasibility(method: str, model: Full3DModel, *, sp: int, tp: int, frames: int) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    heads = model.heads // tp
    if method in ("ulysses", "cp_a2a") and heads % sp:
        return f"head limit: {heads} heads on {sp} ranks"
    if method == "dsp" and sp > frames:
        return f"frame limit: {frames} whole latent frames on {sp} ranks"
    return ""


def predict(method: str, model: Full3DModel, *, tokens: int, frames: int, sp: int, tp: int = 1, dp: int = 1,
            recompute: float = 0.0, hw: Hardware = params.H100) -> Full3DPrediction:
    """One training step (batch 1 per SP group) of ``method``; ``recompute``: the fraction of layers recomputed."""
    why = feasibility(method, model, sp=sp, tp=tp, frames=frames)
    if why:
        return Full3DPrediction(method, False, why)
    c, f, t = model.hidden, model.ffn, model.text_tokens
    # the plan keeps frames whole: the rank with ceil(frames / N) of them sets the pace; the others split tokens
    local = math.ceil(frames / sp) * tokens / frames if method == "dsp" else tokens / sp
    heads = model.heads // tp

    def linear(n: float) -> float:  # n tokens through the linears; the cross-attention's k, v on the text
        return 2 * n * (6 * c * c + 2 * c * f) / tp + 2 * 2 * t * c * c / tp

    def attention(n: float) -> float:  # n queries over every token and over the text
        return 4 * n * tokens * c / tp + 4 * n * t * c / tp

    imbalance = math.ceil(heads / sp) * sp / heads if method != "cp_p2p" else 1.0
    forward = model.layers * (linear(local) + attention(local) * imbalance)
    model_flops = 3 * model.layers * (linear(tokens / sp) + attention(tokens / sp))  # an even share, once
    compute = forward * (3 + recompute) / hw.flops_per_s

    x = local * c * params.BYTES_PER_ELEMENT / tp
    switch = method in ("dsp", "head_switch")
    replays = 1 + (0 if switch else recompute) + 1   # forward, recompute, backward inverse
    sequence = copies = 0.0
    if method == "cp_p2p" and sp > 1:
        chunk = 4 * local * local * c / tp / hw.flops_per_s          # attention of one hop's K/V chunk
        hop_f, hop_b = _link_s(2 * x, sp, tp, hw), _link_s(4 * x, sp, tp, hw)
        exposed = max(0.0, hop_f - chunk) * (1 + recompute) + max(0.0, hop_b - 2 * chunk)
        sequence = model.layers * (sp - 1) * exposed
    elif sp > 1:
        calls = [3 * x, x] if switch else [x, x, x, x]
        sequence = model.layers * replays * sum(_link_s(held * (sp - 1) / sp, sp, tp, hw) for held in calls)
        copies = model.layers * replays * params.COPIES_PER_ALL_TO_ALL * sum(calls) / hw.copy_bytes_per_s
    tp_s = 0.0
    if tp > 1:
        per = _link_s(x * (tp - 1), tp, 1, hw)
        tp_s = model.layers * 6 * (1 + recompute + 1) * per
    d = dp * sp
    dp_s = _link_s(model.parameters / tp * (4 + 2) * (d - 1) / d, d, tp * 1, hw) if d > 1 else 0.0
    return Full3DPrediction(method, True, "", compute, sequence, tp_s, copies, dp_s, model_flops,
                            {"compute": compute, "sequence": sequence, "tp": tp_s, "copies": copies, "dp": dp_s})
