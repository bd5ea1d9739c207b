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

Under ``torch.compile`` a graph can neither read the CPU draw (``.item()``: a break) nor seed a
generator (``manual_seed``, ``fork_rng``: a break). There :func:`sharded_dropout` draws its mask
from a counter-based hash instead (:func:`hashed_keep`, splitmix64's finalizer of the element's
index plus a seed): the seed is the same CPU draw as a traced tensor, mixed with the salt by
tensor ops, moved to the device without a sync; Inductor fuses the hash, the compare and the
multiply into one kernel. The masks keep the properties above (per salt, alike on ranks with one
salt, the CPU generator's advance decides them) but are not eager's masks, as torch's own compiled
dropout draws other numbers than eager's. Attention dropout (inside SDPA's kernel, from the device
generator) cannot take a mask from outside: :func:`rank_dropout_attention` runs it outside the
graph (one break before and after each attention with ``attention_dropout > 0``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

__all__ = ["hashed_keep", "rank_dropout_attention", "rank_rng", "sharded_dropout"]

_MASK = (1 << 63) - 1
_SIGNED = 1 << 64
# splitmix64's constants as int64 (torch's integers are signed; products wrap)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15 - _SIGNED, 0xBF58476D1CE4E5B9 - _SIGNED, 0x94D049BB133111EB - _SIGNED


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


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >>> bits`` (logical: torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def hashed_keep(shape: torch.Size | tuple[int, ...], p: float, seed: torch.Tensor) -> torch.Tensor:
    """A bool keep-mask of ``shape``, each element kept with probability ``1 - p`` (to 2^-24): splitmix64's
    finalizer of ``index * golden + seed``, its top 24 bits a uniform in [0, 1). ``seed``: a 0-dim int64 tensor
    on the mask's device. Pure tensor arithmetic, so it traces (no generator, no host read)."""
    z = torch.arange(math.prod(shape), dtype=torch.int64, device=seed.device) * _GOLDEN + seed
    z = (z ^ _shifted(z, 30)) * _MIX1
    z = (z ^ _shifted(z, 27)) * _MIX2
    z = z ^ _shifted(z, 31)
    return (_shifted(z, 40).to(torch.float32) * 2.0**-24 >= p).view(shape)


def _traced_seed(device: torch.device, salt: tuple[int, ...]) -> torch.Tensor:
    """``rank_rng``'s seed as a tensor: the CPU generator's draw mixed with ``salt`` by tensor ops."""
    seed = torch.randint(0, _MASK, (), dtype=torch.int64, device="cpu")
    for value in salt:
        seed = (seed * 1_000_003 + int(value) + 1) & _MASK
    return seed.to(device)


def sharded_dropout(x: torch.Tensor, p: float, training: bool, *, salt: tuple[int, ...]) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with a mask drawn for this rank's ``salt`` (module docstring); under
    ``torch.compile`` the mask is :func:`hashed_keep`'s, traced."""
    if not training or p == 0:
        return x
    if torch.compiler.is_compiling():
        keep = hashed_keep(x.shape, p, _traced_seed(x.device, salt))
        return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
    with rank_rng(x.device, salt):
        return torch.nn.functional.dropout(x, p=p, training=True)


@torch.compiler.disable
def rank_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
                           dropout_p: float, scale: float | None, salt: tuple[int, ...]) -> torch.Tensor:
    """SDPA with its dropout mask drawn for ``salt`` (``rank_rng``). Run outside any compiled graph: the kernel
    draws the mask from the device generator, which a graph cannot seed per rank (module docstring)."""
    with rank_rng(q.device, salt):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                                scale=scale)
