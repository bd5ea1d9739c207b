"""Stock diffusers video pipelines sample on 2 gloo ranks, their transformer DSP-parallel under its built-in plan
(``dsp_plugin.pipelines.parallelize_pipeline``), equal to the same pipeline on one process; and ``dsp-sample
--model DIR`` takes a directory each of them wrote with ``save_pretrained``.

Oracle: the unmodified pipeline, built alike from the same seed (``dsp_plugin.testing.tiny_pipelines``: tiny
random components, no text encoder, prompt embeddings given, 2 steps with classifier-free guidance, fp32), called
on one process with the same arguments and generator. Compared: the latents after the loop (``output_type=
"latent"``) and the decoded video (LTX-2: and its audio's latents and waveform). The parallel run splits the tokens
inside the transformer only: the same ops on the same values, up to the reduction order of the split attention.
The pooled test compares the latents; the directory test the decoded video (through ``dsp-sample``'s body).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed

MODELS = ["ltx2", "hunyuan-video15", "wan-vace", "kandinsky5"]
BOUND = 1e-5        # relative to max |expected|


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    """The output's arrays by name as tensors (``frames``; LTX-2's ``audio`` too)."""
    return {k: torch.as_tensor(v) for k, v in vars(out).items() if isinstance(v, (torch.Tensor, np.ndarray))}


def _sample(rank: int, n: int, name: str) -> dict[str, Any]:
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.pipelines import parallelize_pipeline
    from dsp_plugin.testing.tiny_pipelines import pipeline_case

    pipe, call = pipeline_case(name)
    expected = _outputs(pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)))
    pipe, call = pipeline_case(name)
    sampler = parallelize_pipeline(pipe)
    with CommAccounting(activations=False) as acct:
        got = _outputs(sampler(**call, output_type="latent", generator=torch.Generator().manual_seed(0)))
    result: dict[str, Any] = {"ops": sorted({r.op for r in acct.records})}
    assert got.keys() == expected.keys(), (got.keys(), expected.keys())
    for key, value in expected.items():
        result[key] = ((got[key] - value).abs().max().item(), value.abs().max().item(), tuple(value.shape))
    pipe, call = pipeline_case(name)         # no generator: the noise rank 0 draws, on every rank
    torch.manual_seed(100 + rank)            # as separate processes' default generators differ
    given = {"latents": expected["frames"]} if name == "ltx2" else {}    # LTX-2 still draws the audio's noise
    result["unseeded"] = _outputs(parallelize_pipeline(pipe)(**call, **given, output_type="latent"))
    return result


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_on_two_ranks_equals_one_process(name: str) -> None:
    results = run_distributed(_sample, 2, name)
    unseeded = [result.pop("unseeded") for result in results]
    for key, value in unseeded[0].items():
        assert torch.equal(value, unseeded[1][key]), (name, key, (value - unseeded[1][key]).abs().max())
    for rank, result in enumerate(results):
        assert "all_to_all" in result.pop("ops"), (name, rank)     # the transformer ran split: the head switch
        for key, (diff, scale, shape) in result.items():
            print(f"{name} rank {rank} latent {key} {shape}: max |diff| {diff:.3g} (max |expected| {scale:.3g})")
            assert diff <= BOUND * max(1.0, scale), (name, rank, key, diff)


def _directory_run(rank: int, n: int, root: str) -> dict[str, list[str]]:
    """``dsp-sample``'s body (``launch.sample.sample``, what each of its processes runs) on every model's directory;
    the collectives each sent."""
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.launch.sample import build_parser, check_args, sample

    ops = {}
    for name in MODELS:
        args = build_parser().parse_args(_directory_argv(root, name))
        check_args(args, n)
        with CommAccounting(activations=False) as acct:
            sample(args)
        ops[name] = sorted({r.op for r in acct.records})
    return ops


def _directory_argv(root: str, name: str) -> list[str]:
    from dsp_plugin.testing.tiny_pipelines import pipeline_case

    _, call = pipeline_case(name)
    return ["--model", f"{root}/{name}", "--call-args", f"{root}/{name}/call_args.pt", "--steps", "2",
            "--guidance", str(call.get("guidance_scale", 4.0)), "--num-frames", str(call["num_frames"]),
            "--height", str(call["height"]), "--width", str(call["width"]), "--output", f"{root}/{name}.pt"]


def test_model_directories_sample_on_two_ranks_equal_diffusers(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Each pipeline written by ``save_pretrained`` and loaded by diffusers (``from_pretrained``, one process) is
    the oracle; ``dsp-sample --model DIR`` on 2 ranks writes the same frames (and LTX-2's audio). The command's
    per-rank body (``check_args`` then ``sample``: load, parallelize, call, write) runs on the pool for every model,
    no process started (a launch costs ~25 s of imports here; ``dsp-sample``'s own launch paths, torchrun and
    ``--dsp N``, are tests/test_sample_command.py's)."""
    from diffusers import DiffusionPipeline

    from dsp_plugin.launch.pipeline_sizes import saved_without
    from dsp_plugin.testing.tiny_pipelines import save_case

    expected = {}
    for name in MODELS:
        call = save_case(name, tmp_path / name)
        loaded = DiffusionPipeline.from_pretrained(tmp_path / name, local_files_only=True,
                                                   **dict.fromkeys(saved_without(tmp_path / name)))
        loaded.set_progress_bar_config(disable=True)
        expected[name] = _outputs(loaded(**call, output_type="np", generator=torch.Generator().manual_seed(0)))
    for ops in run_distributed(_directory_run, 2, str(tmp_path)):
        assert all("all_to_all" in ops[name] for name in MODELS), ops     # the transformer ran split
    got = {name: {"frames": torch.load(tmp_path / f"{name}.pt", weights_only=True)} for name in MODELS}
    got["ltx2"]["audio"] = torch.load(tmp_path / "ltx2.audio.pt", weights_only=True)
    for name, outputs in got.items():
        for key, value in outputs.items():
            ref = torch.as_tensor(expected[name][key])
            diff = (value - ref).abs().max().item()
            print(f"dsp-sample --model DIR {name} {key} {tuple(ref.shape)}: max |diff| {diff:.3g} vs diffusers")
            assert value.shape == ref.shape and diff <= BOUND * max(1.0, ref.abs().max().item()), (name, key, diff)
    from dsp_plugin.launch import sample

    capsys.readouterr()                               # diffusers' loading bars above
    for flag in ("--cfg-parallel", "--vae-tiling"):   # the frame-sharded samplers' options: one line, no process
        with pytest.raises(SystemExit):
            sample.main(["--model", str(tmp_path / "ltx2"), flag])
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"dsp-sample: error: --model {tmp_path / 'ltx2'}: {flag} is for the frame-sharded"), err
