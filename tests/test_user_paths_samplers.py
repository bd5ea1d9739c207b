"""The samplers called every way a user calls them, and the inputs they refuse (issue 25: matrix, item 2).

One 4-rank spawn. For each group style of ``tests.user_paths`` and CFG 2 x DSP 2 (``sampling_groups``),
``parallelize_wan_pipeline`` and ``parallelize_latte_pipeline`` equal diffusers' own pipeline on one
process (latents; Wan bitwise-close, Latte's batch-1 CFG halves within its GEMM rounding, see
docs/inference.md), on videos that are not square (Wan 16x32 pixels, Latte 8x24). Then, on DSP 2 x DP 2,
the silent cases of item 2 each raise on every rank:

- no ``generator``, each process's default generator seeded differently: the noise is drawn once on
  rank 0 and shared, so every rank samples what one process seeded like rank 0 samples (before: a
  video mixed from the ranks' noises, 0.1-0.8 off, exit 0);
- a prompt, a generator seed, latents or prompt embeddings that differ per rank: ``InputMismatch``
  naming the argument on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402
from tests.user_paths import STYLES, GroupStyles  # noqa: E402

STYLES_AND_CFG = (*STYLES, "cfg2_dsp2")


def _wan_kwargs(**extra: Any) -> dict[str, Any]:
    return {"prompt": "a cat walks on the grass", "negative_prompt": "blurry", "height": 16, "width": 32,
            "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 4.0, "max_sequence_length": 8,
            "generator": torch.Generator().manual_seed(0), "output_type": "latent", **extra}


def _latte_kwargs(**extra: Any) -> dict[str, Any]:
    from dsp_plugin.testing.tiny import tiny_prompt_embeds

    prompt, negative = tiny_prompt_embeds()
    return {"prompt_embeds": prompt, "negative_prompt": None, "negative_prompt_embeds": negative,
            "video_length": 7, "height": 8, "width": 24, "num_inference_steps": 2, "guidance_scale": 4.0,
            "generator": torch.Generator().manual_seed(0), "output_type": "latent", **extra}


def _pipes() -> dict[str, Any]:
    from dsp_plugin.testing.tiny import tiny_latte_pipeline, tiny_wan_pipeline

    pipes = {"wan": tiny_wan_pipeline(layers=1), "latte": tiny_latte_pipeline(frames=7, layers=1)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def _sampler(name: str, dsp_group: Any, cfg_group: Any = None) -> Any:
    from dsp_plugin.pipelines import parallelize_latte_pipeline, parallelize_wan_pipeline

    make = parallelize_wan_pipeline if name == "wan" else parallelize_latte_pipeline
    return make(_pipes()[name], dsp_group=dsp_group, cfg_group=cfg_group)


def _kwargs(name: str, **extra: Any) -> dict[str, Any]:
    return (_wan_kwargs if name == "wan" else _latte_kwargs)(**extra)


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dsp_plugin.pipelines import sampling_groups

    styles = GroupStyles()
    pipes = _pipes()
    expected = {name: pipes[name](**_kwargs(name)).frames for name in pipes}         # diffusers, one process
    out: dict[str, Any] = {}
    for style_name in STYLES_AND_CFG:
        if style_name == "cfg2_dsp2":
            dsp_group, cfg_group = sampling_groups(cfg_parallel=True)
        else:
            dsp_group, cfg_group = styles.enter(style_name).group, None
        for name in pipes:
            try:
                frames = _sampler(name, dsp_group, cfg_group)(**_kwargs(name)).frames
                out[f"{style_name}/{name}"] = (frames - expected[name]).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - reported per cell
                out[f"{style_name}/{name}"] = f"{type(exc).__name__}: {exc}"[:300]
    # item 2 on DSP 2 x DP 2: the DSP pair must agree
    styles.enter("dsp2_dp2_topology")
    pair_rank = dist.get_rank() % 2
    for name in pipes:
        torch.manual_seed(100 + rank)                      # each process's default generator: its own stream
        frames = _sampler(name, None)(**_kwargs(name, generator=None)).frames
        torch.manual_seed(100 + rank - pair_rank)          # what the pair's rank 0 drew from
        alone = _pipes()[name](**_kwargs(name, generator=None)).frames
        out[f"no_generator/{name}"] = (frames - alone).abs().max().item()
        seed = torch.Generator().manual_seed(pair_rank)
        out[f"seed/{name}"] = _error(lambda: _sampler(name, None)(**_kwargs(name, generator=seed)))
        shape = (5, 8, 16) if name == "wan" else (7, 4, 12)  # latent frames, height, width: not square
        latents = torch.randn(1, 4, *shape, generator=torch.Generator().manual_seed(rank))
        out[f"latents/{name}"] = _error(lambda: _sampler(name, None)(**_kwargs(name, latents=latents)))
    out["prompt/wan"] = _error(lambda: _sampler("wan", None)(**_kwargs("wan", prompt=["a cat", "a dog"][pair_rank])))
    embeds = _latte_kwargs()["prompt_embeds"] + pair_rank
    out["prompt_embeds/latte"] = _error(lambda: _sampler("latte", None)(**_kwargs("latte", prompt_embeds=embeds)))
    return out


@pytest.mark.slow
def test_samplers_every_group_style_and_the_inputs_they_refuse() -> None:
    results = run_distributed(_worker, 4, timeout=900)
    failures = []
    for rank, d in enumerate(results):
        for key, value in d.items():
            print(f"rank {rank} {key}: {value}")
        for style_name in STYLES_AND_CFG:
            for name, tolerance in (("wan", 1e-5), ("latte", 1e-4)):
                value = d[f"{style_name}/{name}"]
                if isinstance(value, str) or value > tolerance:
                    failures.append(f"rank {rank} {style_name}/{name}: {value}")
        for name in ("wan", "latte"):
            if d[f"no_generator/{name}"] > 1e-5:
                failures.append(f"rank {rank} no_generator/{name}: {d[f'no_generator/{name}']}")
        for key, argument in (("seed/wan", "generator"), ("seed/latte", "generator"), ("latents/wan", "latents"),
                              ("latents/latte", "latents"), ("prompt/wan", "prompt"),
                              ("prompt_embeds/latte", "prompt_embeds")):
            if not (d[key].startswith("InputMismatch") and "differ across the 2 ranks of group" in d[key]
                    and f" {argument} (alike on ranks" in d[key]):
                failures.append(f"rank {rank} {key}: {d[key]}")
    assert not failures, "\n".join(failures)
