"""Bench sizes and method names; no torch import, so the parent process starts fast."""

from __future__ import annotations

from dataclasses import dataclass

#: ``ulysses``: best practice (temporal blocks, DeepSpeed's DistributedAttention); ``ulysses_paper``:
#: what the paper's harness ran (all-to-alls around every attention); see ``dsp_plugin.baselines``.
METHODS = ("dsp", "ulysses_paper", "ulysses", "megatron_sp", "ring")


@dataclass(frozen=True)
class BenchConfig:
    """Model and input of one bench run (the same for every method).

    The model is the reference STDiT with adaLN and cross-attention to a text
    embedding (``text_dim``), the block the paper's harness trained.
    ``checkpointing``: the activation-checkpointing modes to run (every method in each).
    """

    depth: int
    hidden: int
    heads: int
    frames: int
    height: int
    width: int
    batch: int
    text_len: int
    text_dim: int
    warmup: int
    steps: int
    micro_reps: int
    checkpointing: tuple[bool, ...] = (False, True)

    @property
    def spatial(self) -> int:
        return (self.height // 2) * (self.width // 2)

    @property
    def activation_bytes(self) -> int:
        """M of paper Table 3: one layer's activation [B, T, S, D] in fp32, whole group."""
        return self.batch * self.frames * self.spatial * self.hidden * 4

    @property
    def text_bytes(self) -> int:
        """One rank's projected text [B, L_text, D] in fp32 (the cross-attention's keys or values)."""
        return self.batch * self.text_len * self.hidden * 4


QUICK = BenchConfig(depth=2, hidden=32, heads=4, frames=8, height=8, width=8, batch=1, text_len=4, text_dim=16,
                    warmup=1, steps=10, micro_reps=10)
# M = 1 x 32 x 256 x 128 x 4 B = 4 MiB: a rank holds 2 MiB (N=2) or 1 MiB (N=4) per switch.
FULL = BenchConfig(depth=2, hidden=128, heads=4, frames=32, height=32, width=32, batch=1, text_len=16,
                   text_dim=32, warmup=2, steps=12, micro_reps=20)
