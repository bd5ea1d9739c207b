"""Multi-process Latte sampling equals diffusers' unmodified LattePipeline on one process.

Oracle: ``LattePipeline.__call__`` itself (diffusers' loop, unsharded). The DSP
sampler keeps the latents sharded from the first step to the last: inside the
loop only all-to-alls (and, with CFG parallelism, one all_gather of the noise
shard per step) run; the single gather happens after the loop. 8x24 pixels, 4x12 latents: not square, so a
height taken for the width (or the reverse) changes the tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.pipelines import parallelize_latte_pipeline, sampling_groups  # noqa: E402
from dsp_plugin.testing.tiny import tiny_latte_pipeline, tiny_prompt_embeds  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

FRAMES, STEPS, LAYERS = 7, 3, 2
HEIGHT, WIDTH = 8, 24  # pixels: not square (the pipeline takes multiples of 8)


def _kwargs(output_type: str) -> dict:
    prompt, negative = tiny_prompt_embeds()
    return {"prompt_embeds": prompt, "negative_prompt": None, "negative_prompt_embeds": negative,
            "video_length": FRAMES, "height": HEIGHT, "width": WIDTH,
            "num_inference_steps": STEPS, "guidance_scale": 4.0,
            "generator": torch.Generator().manual_seed(0), "output_type": output_type}


def _sample(rank: int, n: int) -> dict[str, object]:
    pipe = tiny_latte_pipeline(frames=FRAMES, layers=LAYERS)
    result: dict[str, object] = {}
    for output_type in ("pt", "latent"):
        expected = pipe(**_kwargs(output_type)).frames            # diffusers' own loop, one process
        for cfg_parallel in (False, True):
            dsp_group, cfg_group = sampling_groups(cfg_parallel=cfg_parallel)
            sampler = parallelize_latte_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
            per_step: list[list[str]] = []
            with CommAccounting(activations=False) as acct:
                seen = [0]

                def on_step(pipe: object, i: int, t: object, kw: dict, acct: CommAccounting = acct) -> dict:
                    per_step.append([r.op for r in acct.records[seen[0]:]])
                    seen[0] = len(acct.records)
                    return {}

                frames = sampler(**_kwargs(output_type), callback_on_step_end=on_step).frames
            tag = f"{output_type}/cfg{int(cfg_parallel)}"
            result[tag] = (frames - expected).abs().max().item()
            result[f"{tag}/scale"] = max(1.0, expected.abs().max().item())
            result[f"{tag}/loop_ops"] = sorted({op for ops in per_step for op in ops})
            result[f"{tag}/after_loop"] = [r.op for r in acct.records[seen[0]:]]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_sampling_equals_single_process_uneven_frames(n: int) -> None:
    """7 frames on 2 and 4 ranks, with and without CFG parallelism, pixels and latents."""
    results = run_distributed(_sample, n)
    _print_figures(n, results)
    for rank, d in enumerate(results):
        for output_type in ("pt", "latent"):
            for cfg in (0, 1):
                tag = f"{output_type}/cfg{cfg}"
                # fp32 1e-5. CFG parallelism runs the transformer on batch 1 instead of 2: the unmodified
                # model's own output already differs by ~4e-7 between the two batch sizes (GEMM rounding),
                # and DDIM amplifies that by guidance_scale / sqrt(alpha_bar) (~60 at t=999) in 3 steps.
                tol = 5e-5 if cfg else 1e-5
                assert d[tag] < tol * d[f"{tag}/scale"], f"rank {rank}/{n} {tag}: differs by {d[tag]:.3g}"
                dsp = n // 2 if cfg else n
                # no gather of the latents inside the loop: all-to-alls, plus the CFG exchange of the noise
                loop = (["all_to_all"] if dsp > 1 else []) + (["all_gather"] if cfg else [])
                assert d[f"{tag}/loop_ops"] == sorted(loop), (tag, d[f"{tag}/loop_ops"])
                assert d[f"{tag}/after_loop"] == (["all_gather"] if dsp > 1 else []), (tag, d)


def _print_figures(n: int, results: list[dict]) -> None:
    for output_type in ("pt", "latent"):
        for cfg in (0, 1):
            tag = f"{output_type}/cfg{cfg}"
            print(f"n={n} {tag}: max |diff| {max(d[tag] for d in results):.3g} "
                  f"(max |expected| {results[0][f'{tag}/scale']:.3g})")


def test_bad_arguments() -> None:
    pipe = tiny_latte_pipeline(frames=FRAMES, layers=1)
    with pytest.raises(ValueError, match="eta=0.5 makes the scheduler step draw noise"):
        parallelize_latte_pipeline(pipe)(**_kwargs("latent"), eta=0.5)
    from diffusers import DDPMScheduler

    pipe.scheduler = DDPMScheduler()
    with pytest.raises(ValueError, match="scheduler DDPMScheduler draws noise in its step"):
        parallelize_latte_pipeline(pipe)
    with pytest.raises(TypeError, match="expected a diffusers LattePipeline, got Linear"):
        parallelize_latte_pipeline(torch.nn.Linear(2, 2))
