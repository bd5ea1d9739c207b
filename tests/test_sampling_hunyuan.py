"""HunyuanVideo samples through diffusers' own ``HunyuanVideoPipeline.__call__`` on 2 and 4 ranks, equal to one
process: the transformer parallelized in place with its built-in plan (``dsp_plugin.parallelize``), nothing else
changed. The latents stay whole on every rank here: the plan splits the video tokens at the first block and
gathers them at ``norm_out`` on every call (its text mask and RoPE are built by the model from the whole
input), so each call sends its all-to-alls and one all_gather. Keeping the latents sharded across the loop,
as ``parallelize_wan_pipeline`` does, needs a plan that takes a frame shard (``Grid``/``Positions``, like
``WAN_PLAN``); see docs/inference.md.

Oracle: the unmodified pipeline on one process. Tiny random model (``dsp_plugin.testing.tiny_video``), a tiny
``AutoencoderKLHunyuanVideo``, prompt embeddings given (no Llama/CLIP), 9 frames -> 3 latent frames, fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402


def _pipe() -> Any:
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    from dsp_plugin.testing.tiny_video import hunyuan_video

    model, _ = hunyuan_video()
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4,
                                    down_block_types=("HunyuanVideoDownBlock3D",) * 2,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 2, block_out_channels=(8, 16),
                                    layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=2,
                                    temporal_compression_ratio=4, mid_block_add_attention=False)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=model, vae=vae.eval(),
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
                                tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _kwargs(output_type: str) -> dict[str, Any]:
    from dsp_plugin.testing.tiny_video import hunyuan_video

    _, inputs = hunyuan_video()
    return {"prompt_embeds": inputs["encoder_hidden_states"][:1],
            "pooled_prompt_embeds": inputs["pooled_projections"][:1],
            "prompt_attention_mask": inputs["encoder_attention_mask"][:1], "height": 16, "width": 16,
            "num_frames": 9, "num_inference_steps": 2, "output_type": output_type,
            "generator": torch.Generator().manual_seed(0)}


def _sample(rank: int, n: int) -> dict[str, Any]:
    import dsp_plugin
    from dsp_plugin.accounting import CommAccounting

    out: dict[str, Any] = {}
    for output_type in ("latent", "pt"):
        expected = _pipe()(**_kwargs(output_type)).frames            # diffusers, one process
        pipe = _pipe()
        dsp_plugin.parallelize(pipe.transformer)                      # the built-in plan, in place
        with CommAccounting(activations=False) as acct:
            frames = pipe(**_kwargs(output_type)).frames
        out[output_type] = ((frames - expected).abs().max().item(), expected.abs().max().item())
        out[f"{output_type}/ops"] = sorted({r.op for r in acct.records})
        out[f"{output_type}/all_gathers"] = sum(r.op == "all_gather" for r in acct.records)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_hunyuan_pipeline_equals_single_process(n: int) -> None:
    for rank, d in enumerate(run_distributed(_sample, n)):
        for output_type in ("latent", "pt"):
            diff, scale = d[output_type]
            print(f"n={n} rank {rank} {output_type}: max |diff| {diff:.3g} (max |expected| {scale:.3g}); "
                  f"collectives {d[f'{output_type}/ops']}, {d[f'{output_type}/all_gathers']} all_gather(s)")
            assert diff < 1e-5 * max(1.0, scale), (n, rank, output_type, diff)
            assert "all_to_all" in d[f"{output_type}/ops"]
            assert d[f"{output_type}/all_gathers"] == 2, d        # one gather at norm_out per step, 2 steps
