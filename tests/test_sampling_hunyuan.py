"""HunyuanVideo samples through diffusers' own ``HunyuanVideoPipeline.__call__`` on 2 and 4 ranks, equal to one
process, two ways:

- the pipeline unmodified, its transformer parallelized in place with the built-in plan
  (``dsp_plugin.parallelize``, ``HUNYUAN_VIDEO_PLAN``): the latents stay whole on every rank, the plan splits the
  flat video tokens at the first block and gathers them at ``norm_out`` on every call (all-to-alls and one
  all_gather);
- ``parallelize_hunyuan_video_pipeline``: the latents sharded on frames from the first step to the last
  (``HUNYUAN_VIDEO_FRAMES_PLAN`` under ``sharded_io``): per step only the head switch's all-to-alls and one small
  all_gather of the text mask's video key columns (the model builds its key-padding mask from the frames it is
  fed), with CFG parallelism one all_gather of the noise shard; one all_gather of the latents after the loop.

Oracle: the unmodified pipeline on one process. Tiny random model (``dsp_plugin.testing.tiny_video``), a tiny
``AutoencoderKLHunyuanVideo``, prompt embeddings given (no Llama/CLIP), fp32: 9 frames -> 3 latent frames for the
unmodified pipeline, 17 frames -> 5 latent frames for the sharded sampler (3+2 on 2 ranks, 2+1+1+1 on 4; on 4
ranks one rank holds none of the 3 heads); 16x32 pixels, 8x16 latents, 4x8 patches: not square, so a height
taken for the width (or the reverse) anywhere on the way changes the tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

STEPS, FRAMES, LATENT_FRAMES, ATTENTIONS = 2, 17, 5, 2   # the tiny model: 1 double- and 1 single-stream block
HEIGHT, WIDTH = 16, 32  # pixels: not square (the pipeline takes multiples of 16)


def _pipe() -> Any:
    from dsp_plugin.testing.tiny_video import hunyuan_video_pipeline

    return hunyuan_video_pipeline()


def _kwargs(output_type: str, num_frames: int = 9, cfg: bool = False) -> dict[str, Any]:
    """Sample 0 of the tiny batch as the prompt (its text padded after 4 of 7 tokens); with ``cfg`` sample 1 as
    the negative prompt (true CFG: a cond call, then an uncond call)."""
    from dsp_plugin.testing.tiny_video import hunyuan_video

    _, inputs = hunyuan_video()
    text, pooled, mask = inputs["encoder_hidden_states"], inputs["pooled_projections"], inputs["encoder_attention_mask"]
    negative = {"negative_prompt_embeds": text[1:], "negative_pooled_prompt_embeds": pooled[1:],
                "negative_prompt_attention_mask": mask[1:], "true_cfg_scale": 3.0} if cfg else {}
    return {"prompt_embeds": text[:1], "pooled_prompt_embeds": pooled[:1], "prompt_attention_mask": mask[:1],
            "height": HEIGHT, "width": WIDTH, "num_frames": num_frames, "num_inference_steps": STEPS,
            "output_type": output_type, "generator": torch.Generator().manual_seed(0), **negative}


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


def _sharded_run(output_type: str, cfg_parallel: bool, expected: torch.Tensor) -> dict[str, Any]:
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.pipelines import parallelize_hunyuan_video_pipeline, sampling_groups

    dsp_group, cfg_group = sampling_groups(cfg_parallel=cfg_parallel)
    sampler = parallelize_hunyuan_video_pipeline(_pipe(), dsp_group=dsp_group, cfg_group=cfg_group)
    seen: list[int] = []                      # the latent frames every transformer call receives
    sampler.models[0].register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].shape[2]),
                                                with_kwargs=True)
    per_step: list[list[str]] = []
    with CommAccounting(activations=False) as acct:
        def on_step(pipe: object, i: int, t: object, kw: dict) -> dict:
            per_step.append([r.op for r in acct.records[sum(map(len, per_step)):]])
            return {}

        frames = sampler(**_kwargs(output_type, FRAMES, cfg=cfg_parallel), callback_on_step_end=on_step).frames
    return {"diff": (frames - expected).abs().max().item(), "scale": expected.abs().max().item(),
            "seen": sorted(set(seen)), "calls": len(seen), "per_step": per_step,
            "after_loop": [r.op for r in acct.records[sum(map(len, per_step)):]]}


def _sharded(rank: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for output_type in ("latent", "pt"):
        for cfg in (False, True):
            expected = _pipe()(**_kwargs(output_type, FRAMES, cfg=cfg)).frames   # diffusers, one process
            out[f"{output_type}/cfg{int(cfg)}"] = _sharded_run(output_type, cfg, expected)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_hunyuan_sampler_equals_single_process_latents_sharded(n: int) -> None:
    """5 latent frames on 2 and 4 ranks, with and without CFG parallelism (true CFG), latents and pixels."""
    results = run_distributed(_sharded, n)
    for tag, d in results[0].items():
        print(f"n={n} {tag}: max |diff| {max(r[tag]['diff'] for r in results):.3g} (max |expected| "
              f"{d['scale']:.3g}); per step rank 0: {[{op: s.count(op) for op in set(s)} for s in d['per_step']]}"
              f"; after the loop: {d['after_loop']}")
    for rank, by_tag in enumerate(results):
        for tag, d in by_tag.items():
            cfg = tag.endswith("cfg1")
            dsp = n // 2 if cfg else n
            assert d["diff"] < 1e-5 * max(1.0, d["scale"]), f"rank {rank}/{n} {tag}: differs by {d['diff']:.3g}"
            local = [LATENT_FRAMES // dsp + (r < LATENT_FRAMES % dsp) for r in range(dsp)][rank % dsp]
            assert d["seen"] == [local], (tag, d["seen"])              # the frame shard on every call
            assert d["calls"] == STEPS, (tag, d["calls"])             # with CFG parallel: one half per rank
            assert len(d["per_step"]) == STEPS, (tag, d["per_step"])
            for ops in d["per_step"]:  # the head switch's all-to-alls, the mask's video columns, the CFG exchange
                assert ops.count("all_to_all") == (2 * ATTENTIONS if dsp > 1 else 0), (tag, ops)
                assert ops.count("all_gather") == (dsp > 1) + cfg, (tag, ops)
                assert set(ops) <= {"all_to_all", "all_gather"}, (tag, ops)
            assert d["after_loop"] == (["all_gather"] if dsp > 1 else []), (tag, d["after_loop"])


def test_bad_pipelines() -> None:
    """Refused at ``parallelize_hunyuan_video_pipeline``, before any hook or collective (no process group here)."""
    import dsp_plugin
    from dsp_plugin.pipelines import parallelize_hunyuan_video_pipeline

    with pytest.raises(TypeError, match="expected a diffusers HunyuanVideoPipeline, got Linear"):
        parallelize_hunyuan_video_pipeline(torch.nn.Linear(2, 2))
    pipe = _pipe()
    pipe.transformer.register_to_config(patch_size_t=2)
    with pytest.raises(ValueError, match=r"patch_size_t=2 patches frames together"):
        parallelize_hunyuan_video_pipeline(pipe)
    assert getattr(pipe.transformer, "_dsp_plan_runtime", None) is None
    pipe = _pipe()
    dsp_plugin.parallelize(pipe.transformer)          # the default flat plan: its tokens are not whole frames
    with pytest.raises(ValueError, match="already parallelized .*another plan than HUNYUAN_VIDEO_FRAMES_PLAN"):
        parallelize_hunyuan_video_pipeline(pipe)


def _bad_distributed(rank: int, n: int) -> dict[str, str]:
    import torch.distributed as dist

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.pipelines import parallelize_hunyuan_video_pipeline, sampling_groups

    dsp_group, cfg_group = sampling_groups(cfg_parallel=True)      # built before the accounting starts
    errors = {}
    with CommAccounting(activations=False) as acct:
        for tag, groups, kwargs in (
                ("frames", {"dsp_group": dist.group.WORLD}, _kwargs("latent", num_frames=9)),
                ("no_negative", {"dsp_group": dsp_group, "cfg_group": cfg_group},
                 {**_kwargs("latent", FRAMES), "true_cfg_scale": 3.0}),
                ("scale_one", {"dsp_group": dsp_group, "cfg_group": cfg_group},
                 {**_kwargs("latent", FRAMES, cfg=True), "true_cfg_scale": 1.0})):
            try:
                parallelize_hunyuan_video_pipeline(_pipe(), **groups)(**kwargs)
            except ValueError as exc:
                errors[tag] = str(exc)
    errors["collectives"] = str([r.op for r in acct.records])
    return errors


@pytest.mark.slow
def test_bad_inputs_raise_on_every_rank_before_a_collective() -> None:
    """Fewer latent frames than DSP ranks; a CFG group where diffusers' rule turns true CFG off (no negative
    prompt, or true_cfg_scale 1; ``guidance_scale`` is the distilled model's embedded guidance, not CFG)."""
    for rank, errors in enumerate(run_distributed(_bad_distributed, 4)):
        assert ("latent frames=3 is smaller than the DSP size 4; expected latent frames >= 4 (num_frames >= 13"
                in errors["frames"]), (rank, errors)
        assert ("true_cfg_scale=3.0 without a negative prompt turns classifier-free guidance off, but the CFG "
                "group has 2 ranks; expected true_cfg_scale > 1 with negative_prompt" in errors["no_negative"]), errors
        assert "true_cfg_scale=1.0 turns classifier-free guidance off" in errors["scale_one"], (rank, errors)
        assert errors["collectives"] == "[]", (rank, errors)
