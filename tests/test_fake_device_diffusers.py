"""The plan runtime and the samplers on a fake GPU node, as local rank 1: bf16 forwards, placement, sampling.

``dsp_plugin.parallelize`` on diffusers' Wan (full 3D: the head switch, 3 heads
on 2 ranks) and CogVideoX (joint text tokens, 3D RoPE tables), each moved to the
device ``dsp_plugin.backend`` chooses (``cuda:LOCAL_RANK``) in bf16; and the
samplers end to end: ``parallelize_wan_pipeline`` (text encoder, transformer,
scheduler, Wan's VAE on the GPU, latents drawn from the user's CPU generator)
and the Latte launch's ``sample()``. Every collective must be on ``cuda:1``, no
CPU tensor may meet a CUDA one, and the outputs land where diffusers puts them.
Forward only (``docs/gpu.md``).

The fake process group answers every collective with this rank's own data, so a
cross-rank agreement (``dsp_plugin.checks``) sees every peer holding what this
rank holds: right for even shards, a false mismatch for uneven ones (rank 0
holds 3 of 5 frames, rank 1 two). Even shapes run with the default check;
uneven ones (5 frames, 3 heads on 2 ranks: rank 1 holds one head) with
``DSP_CHECK=0``, which changes no data path.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from tests.fake_cuda import FakeNode, fake_cuda_node

pytest.importorskip("diffusers")

CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def node() -> Iterator[FakeNode]:
    """The fake node with its DSP topology (the whole world) and the device bound as a launch binds it."""
    from dsp_plugin import backend
    from dsp_plugin.topology import Topology, set_topology

    with fake_cuda_node(local_rank=1) as fake:
        device = backend.choose().device
        assert device == CUDA1, f"dsp_plugin.backend chose {device} for LOCAL_RANK=1"
        torch.cuda.set_device(device)
        set_topology(Topology.world())
        try:
            yield fake
        finally:
            set_topology(None)


@pytest.fixture
def uneven() -> Iterator[None]:
    """``DSP_CHECK=0`` for uneven shards (see the module docstring)."""
    from dsp_plugin.checks import set_check_mode

    set_check_mode("off")
    try:
        yield
    finally:
        set_check_mode(None)


@pytest.mark.parametrize(("frames", "heads"), [(6, 4), (5, 3)], ids=["even", "uneven"])
def test_plan_runtime_wan(node: FakeNode, frames: int, heads: int, request: pytest.FixtureRequest) -> None:
    import dsp_plugin
    from dsp_plugin.testing.tiny import tiny_wan

    if frames % 2 or heads % 2:
        request.getfixturevalue("uneven")
    model = dsp_plugin.parallelize(tiny_wan(layers=2, heads=heads, head_dim=8).to(node.device, torch.bfloat16))
    latents = torch.randn(2, 4, frames, 6, 6, device=node.device, dtype=torch.bfloat16)
    text = torch.randn(2, 7, 16, device=node.device, dtype=torch.bfloat16)
    out = model(latents, torch.tensor([3, 700], device=node.device), text, return_dict=False)[0]
    assert (out.device, out.dtype, tuple(out.shape)) == (CUDA1, torch.bfloat16, (2, 4, frames, 6, 6))
    assert any("alltoall" in op for op, _ in node.collectives), "the head switch issued no all-to-all"


@pytest.mark.usefixtures("uneven")
def test_plan_runtime_cogvideox_with_rope(node: FakeNode) -> None:
    from diffusers import CogVideoXTransformer3DModel

    import dsp_plugin

    model = CogVideoXTransformer3DModel(
        num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=2, sample_width=6, sample_height=6, sample_frames=17, patch_size=2,
        max_text_seq_length=7, use_rotary_positional_embeddings=True)
    model = dsp_plugin.parallelize(model.to(node.device, torch.bfloat16))
    latents = torch.randn(2, 5, 4, 6, 6, device=node.device, dtype=torch.bfloat16)
    text = torch.randn(2, 7, 16, device=node.device, dtype=torch.bfloat16)
    rope = tuple(torch.randn(45, 16, device=node.device) for _ in range(2))   # 5 x 3 x 3 video tokens
    out = model(latents, text, torch.tensor([3, 700], device=node.device), image_rotary_emb=rope,
                return_dict=False)[0]
    assert (out.device, out.dtype, tuple(out.shape)) == (CUDA1, torch.bfloat16, (2, 5, 4, 6, 6))


@pytest.mark.usefixtures("uneven")
def test_wan_sampler(node: FakeNode) -> None:
    from dsp_plugin.pipelines import parallelize_wan_pipeline, sampling_groups
    from dsp_plugin.testing.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(layers=2).to(node.device)
    pipe.set_progress_bar_config(disable=True)
    dsp_group, cfg_group = sampling_groups(cfg_parallel=False)
    sampler = parallelize_wan_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    frames = sampler(prompt="a cat walks on the grass", negative_prompt="blurry", height=16, width=16, num_frames=9,
                     num_inference_steps=2, guidance_scale=4.0, max_sequence_length=8, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).frames
    assert (frames.device, tuple(frames.shape)) == (CUDA1, (1, 9, 3, 16, 16)), (frames.device, frames.shape)


def test_latte_launch_samples(node: FakeNode) -> None:
    from dsp_plugin.launch import sample_latte

    args = sample_latte.parse_args(["--frames", "4", "--steps", "2", "--size", "16"])
    timings = sample_latte.sample(argparse.Namespace(**vars(args)), node.device)
    assert timings, "the launch's sample() returned no timings"
