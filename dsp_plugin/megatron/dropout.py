"""Dropout masks that differ between DSP shards, and survive activation recompute.

Megatron seeds every rank of a pipeline stage alike (``seed + 100 * pp_rank``), so
the ranks of a DSP group (Megatron's context-parallel slot) draw the same dropout
mask for their different tokens: token ``i`` of every shard is dropped together
(Megatron's own context parallelism has the same correlation). :func:`sharded_dropout`
draws each mask from a generator seeded with one draw of the default **CPU**
generator mixed with the rank's coordinates (``salt``):

- the CPU generator advances alike on the ranks (the same code runs everywhere), so
  ranks with the same salt draw the same mask: TP replicas of a replicated
  activation stay replicas (hidden dropout salts with the DSP rank only);
- Megatron's activation checkpoints (``tensor_parallel.checkpoint`` and Transformer
  Engine's) save and restore the CPU generator with the device's, so a recompute draws
  the mask of the first run;
- the device generator is forked around the draw (``fork_rng``): no other random
  stream moves, and nothing is read from the device (no host sync: the seed is a
  CPU draw, the device generator's state a host-side (seed, offset) pair).

With ``p == 0`` or outside training nothing is drawn, so runs without dropout draw
exactly what they drew before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["rank_rng", "sharded_dropout"]

_MASK = (1 << 63) - 1


@contextlib.contextmanager
def rank_rng(device: torch.device, salt: tuple[int, ...]) -> Iterator[None]:
    """Within the block, ``device``'s default generator is seeded from one CPU draw mixed with ``salt``;
    restored on exit (the CPU generator keeps the draw's advance)."""
    # one draw of the CPU generator: alike on every rank, restored by Megatron's checkpoints before a recompute
    seed = int(torch.randint(0, _MASK, (), dtype=torch.int64, device="cpu").item())
    for value in salt:
        seed = (seed * 1_000_003 + int(value) + 1) & _MASK
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]):
            torch.cuda.default_generators[index].manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


def sharded_dropout(x: torch.Tensor, p: float, training: bool, *, salt: tuple[int, ...]) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with a mask drawn for this rank's ``salt`` (module docstring)."""
    if not training or p == 0:
        return x
    with rank_rng(x.device, salt):
        return torch.nn.functional.dropout(x, p=p, training=True)
