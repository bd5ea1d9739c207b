"""Bench sizes and method names; no torch import, so the parent process starts fast."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("dsp", "ulysses", "megatron_sp", "ring")


@dataclass(frozen=True)
class BenchConfig:
    """Model and input of one bench run (the same for every method)."""

    depth: int
    hidden: int
    heads: int
    frames: int
    height: int
    width: int
    batch: int
    warmup: int
    steps: int
    micro_reps: int

    @property
    def spatial(self) -> int:
        return (self.height // 2) * (self.width // 2)

    @property
    def activation_bytes(self) -> int:
        """M of paper Table 3: one layer's activation [B, T, S, D] in fp32, whole group."""
        return self.batch * self.frames * self.spatial * self.hidden * 4


QUICK = BenchConfig(depth=2, hidden=32, heads=4, frames=8, height=8, width=8, batch=1,
                    warmup=1, steps=10, micro_reps=20)
FULL = BenchConfig(depth=4, hidden=64, heads=4, frames=16, height=16, width=16, batch=2,
                   warmup=3, steps=20, micro_reps=50)
