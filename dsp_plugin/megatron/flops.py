"""FLOPs of the spatial-temporal DiT, for Megatron's throughput log (its default is the GPT formula).

Counted per sample as matmul ``2 * m * n * k`` (element-wise ops ignored), ``N = T * S``
tokens, hidden ``D``, MLP width ``F``, text length ``L``::

    per layer:  adaLN 12 D^2 + QKV 6 N D^2 + proj 2 N D^2 + attention 4 N L_a D   (L_a = S or T)
                + cross-attention (2 N D^2 + 4 L D^2 + 4 N L D + 2 N D^2) + MLP 4 N D F
    model:      layers + patch embed 2 N C D + timestep MLP 2 (256 D + D^2) + text 2 L E D
                + head (4 D^2 + 2 N D C)

A training step is 3 forwards (forward, and backward for inputs and weights),
as in Megatron's GPT formula; full recompute adds work that this does not count
(Megatron reports model FLOPs, not hardware FLOPs, either way). DSP does not
change the count: it moves data, not arithmetic.
"""

from __future__ import annotations

import argparse

from dsp_plugin.megatron.config import ATTEND, FRAME_DIM

__all__ = ["forward_flops_per_sample", "install_flops_formula", "num_floating_point_operations"]


def forward_flops_per_sample(*, frames: int, patches: int, channels: int, hidden: int, ffn_hidden: int,
                             num_layers: int, pattern: tuple[str, ...] = ("spatial", "temporal"),
                             text_len: int = 0, text_dim: int = 0) -> int:
    """Forward FLOPs of one sample (see the module docstring)."""
    n, d = frames * patches, hidden
    total = 2 * n * channels * d + 2 * (256 * d + d * d) + 2 * text_len * text_dim * d  # embeddings
    total += 4 * d * d + 2 * n * d * channels  # head
    for layer in range(num_layers):
        attended = frames if ATTEND[pattern[layer % len(pattern)]] == FRAME_DIM else patches
        total += 12 * d * d + 6 * n * d * d + 2 * n * d * d + 4 * n * attended * d + 4 * n * d * ffn_hidden
        if text_len:
            total += 4 * n * d * d + 4 * text_len * d * d + 4 * n * text_len * d
    return total


def num_floating_point_operations(args: argparse.Namespace, batch_size: int,
                                  seqlen_squared_sum_in_batch: float | None = None,
                                  total_real_tokens_in_batch: float | None = None) -> int:
    """Megatron's ``num_floating_point_operations`` for this model (one training step).

    Same signature as ``megatron.training.training.num_floating_point_operations``, which
    ``train()`` and ``training_log()`` call with the packed-sequence statistics as keywords.
    Those describe variable-length token packing (GPT); every sample here has the full
    ``T x S`` tokens, so the count does not use them.
    """
    text_dim = getattr(args, "text_dim", 0) or 0
    return 3 * batch_size * forward_flops_per_sample(
        frames=args.num_frames, patches=args.latent_height * args.latent_width, channels=args.latent_channels,
        hidden=args.hidden_size, ffn_hidden=args.ffn_hidden_size or 4 * args.hidden_size,
        num_layers=args.num_layers, text_len=args.text_len if text_dim else 0, text_dim=text_dim)


def install_flops_formula() -> None:
    """Make ``megatron.training``'s throughput log use this model's FLOPs instead of the GPT formula."""
    from megatron.training import training

    training.num_floating_point_operations = num_floating_point_operations
