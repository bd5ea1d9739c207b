"""Multi-process Wan sampling equals diffusers' unmodified WanPipeline on one process.

Oracle: ``WanPipeline.__call__`` itself (diffusers' loop, unsharded, cond and
uncond as two transformer calls). The DSP sampler keeps the latents sharded on
frames from the first step to the last: the transformer sees this rank's latent
frames on every call, inside the loop only all-to-alls run (and, with CFG
parallelism, one all_gather of the noise shard per step), and the single gather
of the latents happens after the loop. 9 video frames = 5 latent frames
(the tiny VAE halves time): 3+2 on DSP 2, 2+1+1+1 on DSP 4; 16x32 pixels, 8x16 latents: not square, so a
height taken for the width (or the reverse) changes the tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.pipelines import parallelize_wan_pipeline, sampling_groups  # noqa: E402
from dsp_plugin.testing.tiny import tiny_wan_pipeline  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

STEPS, LAYERS, FRAMES, LATENT_FRAMES = 2, 2, 9, 5
HEIGHT, WIDTH = 16, 32  # pixels: not square (the pipeline takes multiples of 16)


def _kwargs(output_type: str, **extra: object) -> dict:
    return {"prompt": "a cat walks on the grass", "negative_prompt": "blurry", "height": HEIGHT, "width": WIDTH,
            "num_frames": FRAMES, "num_inference_steps": STEPS, "guidance_scale": 4.0, "max_sequence_length": 8,
            "generator": torch.Generator().manual_seed(0), "output_type": output_type, **extra}


def _pipe(two_stage: bool = False, expand_timesteps: bool = False):  # noqa: ANN202
    pipe = tiny_wan_pipeline(layers=LAYERS, two_stage=two_stage)
    pipe.register_to_config(expand_timesteps=expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(cfg_parallel: bool, output_type: str, expected: torch.Tensor, two_stage: bool = False,
         expand_timesteps: bool = False, **extra: object) -> dict:
    dsp_group, cfg_group = sampling_groups(cfg_parallel=cfg_parallel)
    pipe = _pipe(two_stage, expand_timesteps)
    sampler = parallelize_wan_pipeline(pipe, dsp_group=dsp_group, cfg_group=cfg_group)
    seen_frames: list[int] = []               # the latent frames every transformer call receives
    calls = [0] * len(sampler.models)
    for k, model in enumerate(sampler.models):
        def seen(m: object, a: object, kw: dict, k: int = k) -> None:
            seen_frames.append(kw["hidden_states"].shape[2])
            calls[k] += 1

        model.register_forward_pre_hook(seen, with_kwargs=True)
    per_step: list[list[str]] = []
    with CommAccounting(activations=False) as acct:
        def on_step(pipe: object, i: int, t: object, kw: dict) -> dict:
            per_step.append([r.op for r in acct.records[sum(map(len, per_step)):]])
            return {}

        frames = sampler(**_kwargs(output_type, **extra), callback_on_step_end=on_step).frames
    return {"diff": (frames - expected).abs().max().item(), "scale": expected.abs().max().item(),
            "seen_frames": sorted(set(seen_frames)), "calls": calls, "per_step": per_step,
            "after_loop": [r.op for r in acct.records[sum(map(len, per_step)):]]}


def _sample(rank: int, n: int) -> dict[str, dict]:
    result = {}
    for output_type in ("pt", "latent"):
        expected = _pipe()(**_kwargs(output_type)).frames               # diffusers' own loop, one process
        for cfg_parallel in (False, True):
            result[f"{output_type}/cfg{int(cfg_parallel)}"] = _run(cfg_parallel, output_type, expected)
    if n == 2:   # Wan 2.2's two-stage layout: both transformers parallelized, each step on diffusers' choice
        expected = _pipe(two_stage=True)(**_kwargs("latent", guidance_scale_2=2.0)).frames
        result["latent/two_stage"] = _run(False, "latent", expected, two_stage=True, guidance_scale_2=2.0)
        # Wan 2.2 TI2V's per-token timesteps: diffusers' loop builds them from the shard's latents
        expected = _pipe(expand_timesteps=True)(**_kwargs("latent")).frames
        result["latent/expand_timesteps"] = _run(False, "latent", expected, expand_timesteps=True)
    return result


def _print_figures(n: int, results: list[dict]) -> None:
    for tag in results[0]:
        d = results[0][tag]
        print(f"n={n} {tag}: max |diff| {max(r[tag]['diff'] for r in results):.3g} (max |expected| "
              f"{d['scale']:.3g}); per step rank 0: {[{op: s.count(op) for op in set(s)} for s in d['per_step']]}"
              f"; after the loop: {d['after_loop']}")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_wan_pipeline_equals_single_process_latents_sharded(n: int) -> None:
    """5 latent frames on 2 and 4 ranks, with and without CFG parallelism, pixels and latents."""
    results = run_distributed(_sample, n)
    _print_figures(n, results)
    for rank, per_tag in enumerate(results):
        for tag, d in per_tag.items():
            cfg = tag.endswith("cfg1")
            dsp = n // 2 if cfg else n
            # fp32. WanPipeline runs cond and uncond as two batch-B calls; so do both halves here.
            assert d["diff"] < 1e-5 * max(1.0, d["scale"]), f"rank {rank}/{n} {tag}: differs by {d['diff']:.3g}"
            local = [LATENT_FRAMES // dsp + (r < LATENT_FRAMES % dsp) for r in range(dsp)][rank % dsp]
            assert d["seen_frames"] == [local], (tag, d["seen_frames"])       # sharded on every call
            # one step on each transformer in the two-stage layout, every step on the one of Wan 2.1
            assert d["calls"] == ([2, 2] if "two_stage" in tag else [STEPS * (1 if cfg else 2)]), (tag, d["calls"])
            assert len(d["per_step"]) == STEPS, (tag, d["per_step"])
            for ops in d["per_step"]:  # no gather of the latents in the loop: all-to-alls, the CFG exchange
                calls = 1 if cfg else 2
                assert ops.count("all_to_all") == (2 * LAYERS * calls if dsp > 1 else 0), (tag, ops)
                assert ops.count("all_gather") == (1 if cfg else 0), (tag, ops)
                assert set(ops) <= {"all_to_all", "all_gather"}, (tag, ops)
            assert d["after_loop"] == (["all_gather"] if dsp > 1 else []), (tag, d["after_loop"])


def _bad_distributed(rank: int, n: int) -> dict[str, str]:
    import torch.distributed as dist

    world = dist.group.WORLD
    dsp_group, cfg_group = sampling_groups(cfg_parallel=True)      # built before the accounting starts
    errors = {}
    with CommAccounting(activations=False) as acct:
        for tag, groups, call in (("cfg4", {"cfg_group": world}, {}),
                                  ("frames", {"dsp_group": world}, {"num_frames": 5}),
                                  ("guidance", {"dsp_group": dsp_group, "cfg_group": cfg_group},
                                   {"guidance_scale": 1.0})):
            try:
                parallelize_wan_pipeline(_pipe(), **groups)(**_kwargs("latent", **call))
            except ValueError as exc:
                errors[tag] = str(exc)
    errors["collectives"] = str([r.op for r in acct.records])
    return errors


@pytest.mark.slow
def test_bad_inputs_raise_on_every_rank_before_a_collective() -> None:
    for rank, errors in enumerate(run_distributed(_bad_distributed, 4)):
        assert "the CFG group has 4 ranks; expected 2" in errors["cfg4"], (rank, errors)
        assert ("latent frames=3 is smaller than the DSP size 4; expected latent frames >= 4 (num_frames >= 7"
                in errors["frames"]), (rank, errors)
        assert "guidance_scale=1.0 turns classifier-free guidance off" in errors["guidance"], (rank, errors)
        assert errors["collectives"] == "[]", (rank, errors)


def test_bad_pipelines() -> None:
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    with pytest.raises(TypeError, match="expected a diffusers WanPipeline, got Linear"):
        parallelize_wan_pipeline(torch.nn.Linear(2, 2))
    for scheduler, name in ((DDPMScheduler(), "DDPMScheduler"),
                            (FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), "FlowMatchEuler")):
        pipe = _pipe()
        pipe.scheduler = scheduler
        with pytest.raises(ValueError, match=f"scheduler {name}\\w* draws noise in its step"):
            parallelize_wan_pipeline(pipe)
    pipe = _pipe()
    pipe.register_to_config(boundary_ratio=0.5)
    with pytest.raises(ValueError, match="boundary_ratio=0.5 switches between two transformers, but the "
                                         "pipeline's transformer_2 is None"):
        parallelize_wan_pipeline(pipe)
    pipe = _pipe()
    pipe.transformer.register_to_config(patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match=r"patch_size=\(2, 2, 2\) patches frames together"):
        parallelize_wan_pipeline(pipe)
    assert getattr(pipe.transformer, "_dsp_plan_runtime", None) is None   # refused before any hook
