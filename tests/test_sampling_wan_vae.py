"""Wan's tiled VAE decode split over the DSP ranks equals diffusers' own ``tiled_decode`` on one process.

Oracle: ``AutoencoderKLWan.tiled_decode`` (and ``WanPipeline.__call__`` with ``vae.enable_tiling``) on one
process. The tiny pipeline's 16x32 pixels (not square) are 8x16 latents; tiles of 8x24 pixels at strides 6x16
are 4x12 latents at strides 3x8: 3 rows (at 0, 3, 6) x 2 columns (at 0, 8) = 6 tiles, overlapping by 2 and 8
pixels. Round-robin: 3 tiles per rank on DSP 2, 2-2-1-1 on DSP 4, 3 per rank of each DSP group under CFG 2 x
DSP 2; a 1x2 grid on DSP 4 leaves two ranks without a tile.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.pipelines import parallelize_wan_pipeline, sampling_groups  # noqa: E402
from dsp_plugin.pipelines.wan_vae import owned_tiles, split_tiled_decode, tile_grid  # noqa: E402
from dsp_plugin.testing.tiny import tiny_wan_pipeline  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

STEPS, LAYERS, FRAMES, LATENT_FRAMES = 2, 2, 9, 5
TILING = {"tile_sample_min_height": 8, "tile_sample_min_width": 24, "tile_sample_stride_height": 6,
          "tile_sample_stride_width": 16}
TILES = 6
# Wan 2.2's VAE (x8 in space): 8x16 latents are 64x128 pixels; tiles of 32x96 at strides 24x64: the same 3x2 grid
WAN22_TILING = (32, 96, 24, 64)
# one row of two tiles (the height is one tile): fewer tiles than 4 ranks
WIDE = {"tile_sample_min_height": 16, "tile_sample_min_width": 24, "tile_sample_stride_height": 16,
        "tile_sample_stride_width": 16}


def _kwargs(**extra: object) -> dict:
    return {"prompt": "a cat walks on the grass", "negative_prompt": "blurry", "height": 16, "width": 32,
            "num_frames": FRAMES, "num_inference_steps": STEPS, "guidance_scale": 4.0, "max_sequence_length": 8,
            "generator": torch.Generator().manual_seed(0), "output_type": "pt", **extra}


def _pipe():  # noqa: ANN202
    pipe = tiny_wan_pipeline(layers=LAYERS)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling(**TILING)
    return pipe


def _wan22_vae():  # noqa: ANN202
    """A tiny Wan 2.2-style VAE: residual blocks, ``patch_size=2`` (tiled_decode's unpatchify path), x8 space."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(3)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[True, False], is_residual=True, in_channels=12, out_channels=12,
                            patch_size=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_temporal=2,
                            scale_factor_spatial=8).eval()


def _decoder_calls(vae: object) -> list[tuple[int, int]]:
    """The (height, width) of every ``vae.decoder`` call, appended as they run."""
    seen: list[tuple[int, int]] = []
    vae.decoder.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape[-2:])))
    return seen


def _latents(seed: int, h: int = 8, w: int = 16) -> torch.Tensor:
    return torch.randn(1, 4, LATENT_FRAMES, h, w, generator=torch.Generator().manual_seed(seed))


def test_tile_grid_and_owners() -> None:
    # diffusers' loops: range(0, 8, 3) x range(0, 8, 4), tiles cut at the edge
    assert tile_grid(8, 8, 4, 6, 3, 4) == [[(0, 0, 4, 6), (0, 4, 4, 4)], [(3, 0, 4, 6), (3, 4, 4, 4)],
                                          [(6, 0, 2, 6), (6, 4, 2, 4)]]
    assert [owned_tiles(6, 4, r) for r in range(4)] == [[0, 4], [1, 5], [2], [3]]
    assert [owned_tiles(2, 4, r) for r in range(4)] == [[0], [1], [], []]


def test_split_copy_equals_diffusers_tiled_decode_one_process() -> None:
    """The copy of the per-tile loop and the blend, on one process (no group), against diffusers' own."""
    with torch.no_grad():
        for vae, z in ((_pipe().vae, _latents(1)), (_wan22_vae(), _latents(2))):
            vae.enable_tiling(**TILING) if vae.config.patch_size is None else vae.enable_tiling(*WAN22_TILING)
            expected = vae.tiled_decode(z).sample
            got = split_tiled_decode(vae, z, group=None).sample
            assert got.shape == expected.shape and torch.equal(got, expected), (got - expected).abs().max()


def _cfg_parallel(expected: torch.Tensor) -> dict:
    """CFG 2 x DSP 2: each 2-rank DSP group splits the tiles (both CFG halves decode the video)."""
    dsp_group, cfg_group = sampling_groups(cfg_parallel=True)
    pipe = _pipe()
    sampler = parallelize_wan_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    calls = _decoder_calls(pipe.vae)
    frames = sampler(**_kwargs()).frames
    return {"equal": torch.equal(frames, expected), "diff": (frames - expected).abs().max().item(),
            "calls": len(calls)}


def test_a_tile_of_an_unexpected_shape_raises() -> None:
    """The tile shapes are computed, not sent: a decoder whose output differs (a diffusers change) is named.
    (Flagged in the exchanged buffer, so every rank raises after the one all_gather: the 2-rank test below.)"""
    vae = _pipe().vae
    vae.decoder.register_forward_hook(lambda m, a, out: out[..., :-1])        # one pixel narrower
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] decoded a tile of another shape"):
        split_tiled_decode(vae, _latents(1), group=None)


def _sample(rank: int, n: int) -> dict:
    reference = _pipe()
    reference_calls = _decoder_calls(reference.vae)
    expected = reference(**_kwargs()).frames                  # diffusers' WanPipeline with tiling, one process
    cfg = _cfg_parallel(expected) if n == 4 else None

    dsp_group, cfg_group = sampling_groups(cfg_parallel=False)
    pipe = _pipe()
    sampler = parallelize_wan_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    calls = _decoder_calls(pipe.vae)
    per_step: list[list[str]] = []
    with CommAccounting(activations=False) as acct:
        def on_step(pipe: object, i: int, t: object, kw: dict) -> dict:
            per_step.append([r.op for r in acct.records[sum(map(len, per_step)):]])
            return {}

        frames = sampler(**_kwargs(), callback_on_step_end=on_step).frames
    result = {"diff": (frames - expected).abs().max().item(), "equal": torch.equal(frames, expected),
              "per_step": per_step, "after_loop": [r.op for r in acct.records[sum(map(len, per_step)):]],
              "calls": len(calls), "reference_calls": len(reference_calls), "cfg": cfg}

    # the decode alone, bitwise: the sampler's decode on this rank's latent frames vs diffusers' on all of them
    with torch.no_grad():
        z = _latents(1)
        expected_video = pipe.vae.decode(z).sample                  # outside the call: diffusers' tiled_decode
        del calls[:]
        with CommAccounting(activations=False) as acct, sampler.intercepted(LATENT_FRAMES, False):
            video = pipe.vae.decode(sampler.shard(z)).sample
        result["decode"] = {"equal": torch.equal(video, expected_video), "calls": len(calls),
                            "ops": [r.op for r in acct.records]}
        # Wan 2.2's layout (patch_size 2: unpatchify), and a grid of fewer tiles than ranks
        for tag, vae, tiling, z in (("wan22", _wan22_vae(), WAN22_TILING, _latents(2)),
                                    ("wide", tiny_wan_pipeline(layers=1).vae, tuple(WIDE.values()), _latents(3))):
            vae.enable_tiling(*tiling)
            tile_calls = _decoder_calls(vae)
            expected_video = vae.tiled_decode(z).sample
            del tile_calls[:]
            video = split_tiled_decode(vae, z, group=dsp_group).sample
            result[tag] = {"equal": torch.equal(video, expected_video), "calls": len(tile_calls),
                           "diff": (video - expected_video).abs().max().item()}
        if n == 2:     # rank 0's decoder returns a tile of another shape: both ranks raise, naming rank 0
            vae = _pipe().vae
            if rank == 0:
                vae.decoder.register_forward_hook(lambda m, a, out: out[..., :-1])
            try:
                split_tiled_decode(vae, _latents(1), group=dsp_group)
                result["bad_shape"] = "no error"
            except RuntimeError as exc:
                result["bad_shape"] = str(exc)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_wan_tiled_decode_split_over_dsp_equals_single_process(n: int) -> None:
    results = run_distributed(_sample, n)
    for rank, d in enumerate(results):
        mine = len(owned_tiles(TILES, n, rank))
        print(f"n={n} rank {rank}: max |diff| {d['diff']:.3g} (bitwise {d['equal']}); after the loop "
              f"{d['after_loop']}; decoder calls {d['calls']} (one process {d['reference_calls']}); "
              f"decode alone bitwise {d['decode']['equal']}, {d['decode']['ops']}; wan22 {d['wan22']}; "
              f"wide {d['wide']}; cfg 2 x dsp 2 {d['cfg']}")
        assert d["equal"], f"rank {rank}/{n}: differs by {d['diff']:.3g}"
        assert d["reference_calls"] == TILES * LATENT_FRAMES, d["reference_calls"]
        # this rank's tiles only, each through every latent frame
        assert d["calls"] == mine * LATENT_FRAMES, (rank, d["calls"])
        assert d["decode"]["calls"] == mine * LATENT_FRAMES, (rank, d["decode"])
        for ops in d["per_step"]:        # the loop is unchanged: the head switch's all-to-alls only
            assert set(ops) == {"all_to_all"}, ops
        # after the loop: the latents gathered, then the decoded tiles exchanged; nothing else
        assert d["after_loop"] == ["all_gather", "all_gather"], d["after_loop"]
        assert d["decode"]["equal"] and d["decode"]["ops"] == ["all_gather", "all_gather"], d["decode"]
        assert d["wan22"]["equal"], d["wan22"]
        assert d["wan22"]["calls"] == len(owned_tiles(6, n, rank)) * LATENT_FRAMES, d["wan22"]   # 3x2 tiles
        assert d["wide"]["equal"], d["wide"]
        assert d["wide"]["calls"] == len(owned_tiles(2, n, rank)) * LATENT_FRAMES, d["wide"]     # 0 on 2 of 4
        if n == 2:
            assert "rank(s) [0] decoded a tile of another shape" in d["bad_shape"], d["bad_shape"]
        if n == 4:      # CFG 2 x DSP 2: DSP rank = rank % 2 (sampling_groups keeps DSP ranks adjacent)
            assert d["cfg"]["equal"], d["cfg"]
            assert d["cfg"]["calls"] == len(owned_tiles(TILES, 2, rank % 2)) * LATENT_FRAMES, d["cfg"]
