"""Stock diffusers video pipelines sample on 2 gloo ranks, their transformer DSP-parallel under its built-in plan
(``dsp_plugin.pipelines.parallelize_pipeline``), equal to the same pipeline on one process; and ``dsp-sample
--model DIR`` takes a directory each of them wrote with ``save_pretrained``.

Oracle: the unmodified pipeline, built alike from the same seed (``dsp_plugin.testing.tiny_pipelines``: tiny
random components, no text encoder, prompt embeddings given, 2 steps with classifier-free guidance, fp32), called
on one process with the same arguments and generator. Compared: the latents after the loop (``output_type=
"latent"``) and the decoded video (LTX-2: and its audio's latents and waveform). The parallel run splits the tokens
inside the transformer only: the same ops on the same values, up to the reduction order of the split attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

MODELS = ["ltx2", "hunyuan-video15", "wan-vace", "kandinsky5"]
BOUND = 1e-5        # relative to max |expected|


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    """The output's tensors by name (``frames``/``videos``; LTX-2's ``audio`` too)."""
    return {k: v for k, v in vars(out).items() if isinstance(v, torch.Tensor)}


def _sample(rank: int, n: int, name: str) -> dict[str, Any]:
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.pipelines import parallelize_pipeline
    from dsp_plugin.testing.tiny_pipelines import pipeline_case

    result = {}
    for output_type in ("latent", "pt"):
        pipe, call = pipeline_case(name)
        expected = _outputs(pipe(**call, output_type=output_type, generator=torch.Generator().manual_seed(0)))
        pipe, call = pipeline_case(name)
        sampler = parallelize_pipeline(pipe)
        with CommAccounting(activations=False) as acct:
            got = _outputs(sampler(**call, output_type=output_type, generator=torch.Generator().manual_seed(0)))
        result[f"{output_type}/ops"] = sorted({r.op for r in acct.records})
        assert got.keys() == expected.keys(), (got.keys(), expected.keys())
        for key, value in expected.items():
            result[f"{output_type}/{key}"] = ((got[key] - value).abs().max().item(), value.abs().max().item(),
                                              tuple(value.shape))
    return result


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_on_two_ranks_equals_one_process(name: str) -> None:
    for rank, result in enumerate(run_distributed(_sample, 2, name)):
        for output_type in ("latent", "pt"):      # the transformer ran split: the plan's head switch
            assert "all_to_all" in result.pop(f"{output_type}/ops"), (name, rank, output_type)
        for key, (diff, scale, shape) in result.items():
            print(f"{name} rank {rank} {key} {shape}: max |diff| {diff:.3g} (max |expected| {scale:.3g})")
            assert diff <= BOUND * max(1.0, scale), (name, rank, key, diff)
