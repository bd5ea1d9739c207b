"""Wan's tiled VAE decode with its spatial tiles split over the DSP ranks, equal to diffusers' ``tiled_decode``.

Wan's decoder (``AutoencoderKLWan``) is causal in time: a feature cache is carried from latent frame to
latent frame, so a frame's pixels depend on every earlier frame and a split over frames cannot equal one
process. Its spatial tiling (``vae.enable_tiling()``) is what splits exactly: ``tiled_decode`` decodes
overlapping spatial tiles independently (each through every frame, the cache cleared per tile), then blends
each tile with its upper and left neighbours and crops it. Here each DSP rank decodes its tiles only (round-robin
in diffusers' row-major order: tile ``k`` on rank ``k % N``), the decoded tiles are exchanged in one all_gather
of a padded flat buffer (every tile's shape follows from its coordinates, so no shapes are sent), and every rank
blends, crops, unpatchifies and clamps as diffusers does, with the VAE's own ``blend_v``/``blend_h``. A rank
with no tile (fewer tiles than ranks) sends padding only.

The per-tile loop and the blend follow diffusers 0.42.1's ``AutoencoderKLWan.tiled_decode``;
``tests/test_sampling_wan_vae.py`` compares them with diffusers' own on one process, so a change there fails it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsp_plugin.comm import gather, group_rank, group_size

__all__ = ["owned_tiles", "split_tiled_decode", "tile_grid"]


def tile_grid(height: int, width: int, tile_height: int, tile_width: int, stride_height: int,
              stride_width: int) -> list[list[tuple[int, int, int, int]]]:
    """Latent tiles ``(top, left, height, width)`` by rows, in ``tiled_decode``'s order (edge tiles cut short)."""
    return [[(i, j, min(tile_height, height - i), min(tile_width, width - j))
             for j in range(0, width, stride_width)] for i in range(0, height, stride_height)]


def owned_tiles(count: int, n: int, rank: int) -> list[int]:
    """The row-major tile indices rank ``rank`` of ``n`` decodes: round-robin (tile ``k`` on rank ``k % n``)."""
    return list(range(rank, count, n))


def split_tiled_decode(vae: Any, z: torch.Tensor, return_dict: bool = True, *,
                       group: dist.ProcessGroup | None) -> Any:
    """``vae.tiled_decode(z, return_dict)`` with the tiles decoded across ``group``; the result on every rank.

    ``z`` is the whole latent video ``[B, C, F, h, w]`` on every rank (each tile goes through every frame).
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import DecoderOutput, unpatchify

    _, _, num_frames, height, width = z.shape
    ratio, patch = vae.spatial_compression_ratio, vae.config.patch_size
    grid = tile_grid(height, width, vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio,
                     vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio)
    # pixels per latent pixel out of the decoder (before unpatchify), as tiled_decode's sizes assume
    up = ratio // patch if patch is not None else ratio
    stride_h, stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    min_h, min_w = vae.tile_sample_min_height, vae.tile_sample_min_width
    if patch is not None:
        stride_h, stride_w, min_h, min_w = stride_h // patch, stride_w // patch, min_h // patch, min_w // patch
    blend_height, blend_width = min_h - stride_h, min_w - stride_w
    sample_height, sample_width = height * ratio, width * ratio
    if patch is not None:
        sample_height, sample_width = sample_height // patch, sample_width // patch

    # every tile's decoded shape: [B, out_channels, frames out, h * up, w * up]
    frames_out = 1 + (num_frames - 1) * 2 ** sum(vae.temperal_upsample)
    lead = (z.shape[0], vae.config.out_channels, frames_out)
    tiles = [t for row in grid for t in row]
    shapes = [(*lead, h * up, w * up) for _, _, h, w in tiles]
    sizes = [torch.Size(s).numel() for s in shapes]
    n, rank = group_size(group), group_rank(group)
    mine = owned_tiles(len(tiles), n, rank)
    block = max(sum(sizes[k] for k in owned_tiles(len(tiles), n, r)) for r in range(n)) + 1   # + 1: the flag
    send = torch.zeros(block, dtype=z.dtype, device=z.device)
    offset = 0
    for k in mine:     # the per-tile loop of diffusers' tiled_decode, on this rank's tiles
        i, j, h, w = tiles[k]
        vae.clear_cache()
        time = []
        for f in range(num_frames):
            vae._conv_idx = [0]
            tile = vae.post_quant_conv(z[:, :, f:f + 1, i:i + h, j:j + w])
            time.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=(f == 0)))
        decoded = torch.cat(time, dim=2)
        if tuple(decoded.shape) != shapes[k]:     # flagged, raised on every rank after the exchange: no hang
            send[-1] = 1
        else:
            send[offset:offset + sizes[k]].copy_(decoded.reshape(-1))
        offset += sizes[k]
    vae.clear_cache()
    recv = gather(send.unsqueeze(0), 0, group=group, global_len=n)      # [n, block]: one all_gather
    if recv[:, -1].any():
        bad = [r for r in range(n) if recv[r, -1] != 0]
        raise RuntimeError(f"split_tiled_decode: rank(s) {bad} decoded a tile of another shape than "
                           f"[B, out_channels, 1 + (F - 1) * temporal scale, h * {up}, w * {up}] (the shape this "
                           f"copy of diffusers' tiled_decode assumes); has AutoencoderKLWan's decoder changed?")
    decoded_tiles: list[torch.Tensor] = [torch.empty(0)] * len(tiles)
    for r in range(n):
        offset = 0
        for k in owned_tiles(len(tiles), n, r):
            decoded_tiles[k] = recv[r, offset:offset + sizes[k]].view(shapes[k])
            offset += sizes[k]
    rows, k = [], 0
    for row in grid:
        rows.append(decoded_tiles[k:k + len(row)])
        k += len(row)

    # the blend of diffusers' tiled_decode (in place, as there: a tile is blended with its blended neighbours)
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend_height)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_width)
            result_row.append(tile[:, :, :, :stride_h, :stride_w])
        result_rows.append(torch.cat(result_row, dim=-1))
    dec = torch.cat(result_rows, dim=3)[:, :, :, :sample_height, :sample_width]
    if patch is not None:
        dec = unpatchify(dec, patch_size=patch)
    dec = torch.clamp(dec, min=-1.0, max=1.0)
    if not return_dict:
        return (dec,)
    return DecoderOutput(sample=dec)
