"""Every number the scale model uses, each with where it comes from.

Three kinds of numbers live here and nowhere else:

* hardware (H100 SXM, NVLink 4, NDR InfiniBand): vendor datasheets, with the
  achievable fraction taken from nccl-tests style measurements and marked as an
  assumption where it is one;
* the paper's settings (Tables 4-7 of the DSP paper, appendix A.3) and the
  claims the paper reports (sections 5.1-5.2), copied verbatim;
* modelling assumptions (utilization, activation checkpointing, overlap) that
  the paper does not state: each says so.

Change a number here and every prediction follows; ``python -m dsp_plugin.bench
--scale-only`` prints the result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its two interconnect tiers (alpha = latency, beta = bytes/s per GPU)."""

    peak_flops: float
    utilization: float
    hbm_bytes: float
    gpus_per_node: int
    nvlink_alpha_s: float
    nvlink_bytes_per_s: float
    ib_alpha_s: float
    ib_bytes_per_s: float


H100 = Hardware(
    # NVIDIA H100 SXM5 datasheet: 989.4 TFLOPS dense BF16 tensor core.
    peak_flops=989.4e12,
    # ASSUMPTION: model FLOPs utilization of the compute that remains after
    # sequence parallelism. 0.45 sits in the 40-52% range Megatron-LM reports for
    # large transformers (Narayanan et al., SC21, Table 1) and is applied to every
    # method alike, so it cancels in the method ratios.
    utilization=0.45,
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3.
    hbm_bytes=80e9,
    # The paper: "NVLink within nodes and InfiniBand across nodes"; DGX/HGX H100 has 8 GPUs a node.
    gpus_per_node=8,
    # ASSUMPTION from nccl-tests on DGX H100: a few microseconds per NVLink collective step.
    nvlink_alpha_s=5e-6,
    # NVLink 4: 900 GB/s per GPU bidirectional = 450 GB/s each way (datasheet). nccl-tests
    # all-to-all on DGX H100 reaches roughly 80% of that: 360 GB/s per GPU each way.
    nvlink_bytes_per_s=360e9,
    # ASSUMPTION: InfiniBand NDR hop latency plus NCCL proxy overhead, ~10 us per step.
    ib_alpha_s=10e-6,
    # DGX H100: one ConnectX-7 NDR 400 Gb/s port per GPU = 50 GB/s each way; nccl-tests
    # inter-node bus bandwidth is ~45 GB/s per GPU (90%). The paper does not state its fabric.
    ib_bytes_per_s=45e9,
)


@dataclass(frozen=True)
class ModelSize:
    """Paper Table 4 (appendix A.3.1). ``mlp_ratio`` follows OpenSora's STDiT (4)."""

    name: str
    layers: int
    hidden: int
    heads: int
    mlp_ratio: int = 4


# Table 4. The paper prints the 3B hidden size as 2038, which its 32 heads do not divide: read as
# 2048, as ``STDiTConfig.preset("3B")`` does. Block parameters: 28 x 2 x 12 x 1152^2 = 0.89B for
# "720M" (the name follows OpenSora, whose cross-attention the paper removed).
MODELS = {
    "720M": ModelSize("720M", layers=28, hidden=1152, heads=16),
    "3B": ModelSize("3B", layers=36, hidden=2048, heads=32),
}

# Appendix A.3.2: "The spatial sequence ... was fixed at 1024x1024. After applying the VAE and
# Patch Embedding, the final length for the spatial sequence was 4096."
SPATIAL = 4096
BYTES_PER_ELEMENT = 2  # ASSUMPTION: bf16 activations and communication (the paper does not say).

# ASSUMPTION: full activation checkpointing of every block. Without it the 720M model at 0.5M
# tokens on SP=2 would store ~0.5 TB of activations per GPU, so the paper's Table 5 sizes only
# fit with recomputation (OpenSora trains with grad_checkpoint=True). Effect: forward compute
# and forward collectives run twice per step.
ACTIVATION_CHECKPOINTING = True

# ASSUMPTION: ring attention overlaps each K/V hop with the attention of the previous chunk
# (as ring implementations do); all other collectives sit on the critical path.
RING_OVERLAP = True

# ASSUMPTION for the memory check: bytes per (token x hidden) element that one block holds while
# it runs (recomputed) forward + backward, beyond the checkpointed block inputs. ~16 bf16 tensors
# of the hidden size (q, k, v, out, 2 LN outputs, residuals) and the 4x MLP hidden twice.
WORKING_SET_ELEMENTS_PER_TOKEN_DIM = 24


@dataclass(frozen=True)
class E2ESetting:
    """Table 5 row: per method (sequence_parallel_size, data_parallel_size); None = not run."""

    model: str
    tokens: str
    temporal: int
    parallel: dict[str, tuple[int, int] | None]


# Table 5 (appendix A.3.2), 128 H100, ZeRO-2 for all but Megatron-SP. Ring's "(2, 46)" for
# 720M/0.5M is printed that way in the paper; it must be (2, 64) to fill 128 GPUs.
E2E = [
    E2ESetting("720M", "0.5M", 128, {"ulysses": (2, 64), "megatron_sp": (2, 64), "ring": (2, 64), "dsp": (2, 64)}),
    E2ESetting("720M", "1M", 256, {"ulysses": (4, 32), "megatron_sp": (4, 32), "ring": (4, 32), "dsp": (4, 32)}),
    E2ESetting("720M", "2M", 512, {"ulysses": (8, 16), "megatron_sp": (16, 8), "ring": (8, 16), "dsp": (8, 16)}),
    E2ESetting("720M", "4M", 1024, {"ulysses": (16, 8), "megatron_sp": None, "ring": (16, 8), "dsp": (16, 8)}),
    E2ESetting("3B", "0.5M", 128, {"ulysses": (4, 32), "megatron_sp": (4, 32), "ring": (4, 32), "dsp": (4, 32)}),
    E2ESetting("3B", "1M", 256, {"ulysses": (8, 16), "megatron_sp": (16, 8), "ring": (8, 16), "dsp": (8, 16)}),
    E2ESetting("3B", "2M", 512, {"ulysses": (16, 8), "megatron_sp": None, "ring": (16, 8), "dsp": (16, 8)}),
    E2ESetting("3B", "4M", 1024, {"ulysses": (32, 4), "megatron_sp": None, "ring": (32, 4), "dsp": (32, 4)}),
]

# Table 7 (weak scaling, SP only, SP size = GPU count, batch grows with GPUs).
# (model, tier, temporal, [(gpus, batch), ...]). The 720M inter-node rows stop at 32 in the table.
WEAK = [
    ("720M", "intra", 64, [(1, 1), (2, 2), (4, 4), (8, 8)]),
    ("720M", "inter", 256, [(8, 1), (16, 2), (32, 4)]),
    ("3B", "intra", 16, [(1, 1), (2, 2), (4, 4), (8, 8)]),
    ("3B", "inter", 128, [(8, 1), (16, 2), (32, 4), (64, 8)]),
]

# Table 6 (strong scaling, batch 1). The table gives no GPU counts; section 5.2 says intra-node
# runs go to 8 GPUs and inter-node runs "up to 64 GPUs": ASSUMED 1-8 and 8-64 in powers of two.
STRONG = [
    ("720M", "intra", 64, [1, 2, 4, 8]),
    ("720M", "inter", 256, [8, 16, 32, 64]),
    ("3B", "intra", 16, [1, 2, 4, 8]),
    ("3B", "inter", 128, [8, 16, 32, 64]),
]

# What the paper reports in text (sections 5.1, 5.2, 6); the figures' bar values are not in the text.
PAPER_CLAIMS = {
    "e2e_dsp_over_ulysses": "DSP 32% to 75% faster than DeepSpeed-Ulysses (sec 5.1, Fig 5)",
    "e2e_dsp_over_others": "up to 10x faster than Megatron-SP and Ring attention (sec 5.1)",
    "e2e_flops_drop": "0.5M -> 4M tokens: DSP FLOPS drop <= 23%, others >= 40% (sec 5.1)",
    "weak_margin": "weak scaling: DSP outperforms others by > 80.7% (sec 5.2, Fig 6)",
    "weak_loss": "weak scaling: 15% loss from 8 to 64 GPUs for DSP (sec 5.2)",
}
PAPER_E2E_DSP_OVER_ULYSSES = (0.32, 0.75)
PAPER_E2E_DSP_OVER_OTHERS_MAX = 10.0
PAPER_WEAK_LOSS_8_TO_64 = 0.15
