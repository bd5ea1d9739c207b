"""Every built-in plan sampled without autograd (the sampling bypass, ``_Runtime.bypass``) equals one process.

In a forward without autograd a pass-through block (a ``Block`` alone: no ``attends``, ``out_shard`` or
``follow``) runs without its hooks; a block whose hooks split conditioning that follows its tokens (``follow``:
LTX-Video's per-token timestep, SkyReels-V2's diffusion forcing) or switch must not. ``tests/test_plan_models.py``
runs the plans with autograd only, where nothing is bypassed. Here each built-in plan's model (the tiny models of
``dsp_plugin.testing.tiny_video``, CogVideoX, SVD's spatio-temporal transformer, the reference STDiT on 2 and 3
axes) is called twice under ``torch.no_grad`` on 2 gloo ranks (the first call checks the inputs across ranks, the
second is the steady state) against the unmodified model on one process, in fp64: the outputs within rounding of
the summation order, and the block calls that ran without their hooks counted. One run over the cases (a run of
the rank pool costs more than a tiny model's three forwards); every failure names its case.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402

# the tiny_video cases (all of them: LTX-Video with a per-token timestep, SkyReels-V2's three modes, the tiny Wan
# and Latte), then the plans tiny_video has no model for
TINY_VIDEO = ["tiny-wan", "tiny-latte", "tiny-hunyuan-video", "tiny-ltx-video", "tiny-ltx-video-per-token",
              "tiny-mochi", "tiny-skyreels-v2", "tiny-skyreels-v2-df", "tiny-skyreels-v2-causal", "tiny-easyanimate",
              "tiny-allegro", "tiny-consisid", "tiny-framepack", "tiny-wan-vace", "tiny-wan-animate", "tiny-chronoedit",
              "tiny-anyflow", "tiny-minimax-h3", "tiny-ltx2", "tiny-cosmos", "tiny-kandinsky6",
              "tiny-kandinsky5", "tiny-motif-video", "tiny-hunyuan-video15", "tiny-helios", "tiny-sana-video"]
OTHERS = ["cogvideox", "svd", "stdit-2-axes", "stdit-3-axes"]
# as tests/test_plan_models.py: where the model computes in fp32 whatever the dtype, that rounding is fp32's
FP32_INSIDE = ("tiny-mochi", "tiny-skyreels-v2", "tiny-easyanimate", "tiny-consisid", "tiny-wan", "tiny-wan-vace",
               "tiny-wan-animate", "tiny-chronoedit", "tiny-anyflow", "tiny-minimax-h3", "tiny-ltx2", "tiny-cosmos",
               "tiny-kandinsky6", "tiny-helios", "tiny-sana-video")
# these fail in fp64 (their time embeddings feed fp32 to layers of the model's dtype): run in fp32, to 1e-5
FP32_ONLY = ("tiny-kandinsky5", "tiny-motif-video")
# block calls that ran without their hooks in the two calls, measured: each 2-layer plan whose blocks are a
# ``Block`` alone passes through at its second block (the first splits). Not bypassed: blocks that split
# conditioning with their tokens (``follow``: LTX-Video's timestep, SkyReels-V2's modulation, Latte, SVD) or other
# arguments (ConsisID, Framepack), that switch (Latte, SVD, STDiT), and HunyuanVideo's single-stream block, whose
# layout is not the double-stream block's that handed the placement on.
# Measured as well: Wan VACE its second control block and second main block per call, Wan Animate (4 blocks, a
# face adapter after blocks 0 and 2) one block per call, ChronoEdit its second block, HunyuanVideo 1.5 its second
# block (its plan's blocks are a ``Block`` alone; the mask its processor builds from a rank's tokens is laid out for
# the global sequence by the head switch, ``Heads``, which a bypassed block keeps: equal to one process to 2e-16).
BYPASSED = {"tiny-wan": 2, "tiny-mochi": 2, "tiny-easyanimate": 2, "tiny-allegro": 2, "cogvideox": 2,
            "tiny-wan-vace": 4, "tiny-wan-animate": 2, "tiny-chronoedit": 2, "tiny-hunyuan-video15": 2}


def _cogvideox() -> tuple[torch.nn.Module, dict[str, Any]]:
    """CogVideoX 5b's layout (3D RoPE passed in by the pipeline), 3 heads, 5 frames of 3x3 patches, 7 text tokens."""
    from diffusers import CogVideoXTransformer3DModel

    from dsp_plugin.testing.tiny_video import fill_zeros

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=2, sample_width=6, sample_height=6, sample_frames=17, patch_size=2,
        max_text_seq_length=7, use_rotary_positional_embeddings=True)
    g = torch.Generator().manual_seed(4)
    return fill_zeros(model), {
        "hidden_states": torch.randn(2, 5, 4, 6, 6, generator=g),  # [B, F, C, H, W]
        "encoder_hidden_states": torch.randn(2, 7, 16, generator=g), "timestep": torch.tensor([3, 700]),
        "image_rotary_emb": (torch.randn(45, 16, generator=g), torch.randn(45, 16, generator=g))}


def _svd() -> tuple[torch.nn.Module, dict[str, Any]]:
    """SVD's transformer on 2 samples of 5 frames (uneven on 2 ranks), 4x4 pixels; the second sample images only."""
    from dsp_plugin.testing.tiny import tiny_spatiotemporal

    g = torch.Generator().manual_seed(4)
    indicator = torch.zeros(2, 5)
    indicator[1] = 1.0
    return tiny_spatiotemporal(layers=2), {
        "hidden_states": torch.randn(10, 32, 4, 4, generator=g),
        "encoder_hidden_states": torch.randn(10, 3, 16, generator=g), "image_only_indicator": indicator}


def _stdit(axes: int) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    def build() -> tuple[torch.nn.Module, dict[str, Any]]:
        from dsp_plugin.models.stdit import STDiT, STDiTConfig

        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return STDiT(STDiTConfig.preset("tiny", axes=axes)), {
            "latents": torch.randn(2, 4, 5, 6, 6, generator=g), "timestep": torch.tensor([3, 500]),
            "text": torch.randn(2, 3, 16, generator=g)}

    return build


def _case(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    from dsp_plugin.testing.tiny_video import case, cast

    if name in TINY_VIDEO:
        return case(name, torch.float32 if name in FP32_ONLY else torch.float64)
    build = {"cogvideox": _cogvideox, "svd": _svd, "stdit-2-axes": _stdit(2), "stdit-3-axes": _stdit(3)}[name]
    model, kwargs = build()
    return model.double(), cast(kwargs, torch.float64)


def _output(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
    if "latents" in kwargs:  # the reference STDiT returns the tensor
        return model(**kwargs)
    return model(**kwargs, return_dict=False)[0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def _sample(model: torch.nn.Module, reference: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    from dsp_plugin.plan.wrap import wrappers

    taken: list[bool] = []
    for wrapper in wrappers(model):
        if wrapper.bypass is not None:
            def counted(*args: object, _bypass: Any = wrapper.bypass) -> object:
                token = _bypass(*args)
                taken.append(token is not None)
                return token

            wrapper.bypass = counted
    with torch.no_grad():
        expected = _output(reference, kwargs)
        first = _output(model, kwargs)
        second = _output(model, kwargs)  # the steady state: nothing is checked across ranks
    return {"first": _relative(first, expected), "second": _relative(second, expected), "bypassed": sum(taken)}


def _every_plan(rank: int, n: int) -> dict[str, Any]:
    """{case: its figures}, or at a case that raised {case: the error}, the cases after it not run (a rank that
    raised inside a forward may have left the other in a collective)."""
    import dsp_plugin

    result: dict[str, Any] = {}
    for name in TINY_VIDEO + OTHERS:
        reference, kwargs = _case(name)
        try:
            model = dsp_plugin.parallelize(copy.deepcopy(reference))  # no plan: the built-in one for its class
            result[name] = _sample(model, reference, kwargs)
        except Exception as error:  # noqa: BLE001 - named with its case by the test
            result[name] = f"{type(error).__name__}: {error}"
            break
    return result


def test_every_builtin_plan_sampled_without_autograd_equals_one_process() -> None:
    """One run over the cases (a run costs more than a tiny model's three forwards); each message names its case."""
    failures = []
    for rank, by_name in enumerate(run_distributed(_every_plan, 2, timeout=600)):
        for name, d in by_name.items():
            print(f"{name} rank {rank}/2: {d}")
            where = f"{name} sampled without autograd, rank {rank}/2"
            if isinstance(d, str):
                failures.append(f"{where}: raised {d}")
                continue
            tol = 1e-5 if name in FP32_ONLY else 1e-6 if name in FP32_INSIDE else 1e-12
            failures += [f"{where}: the {call} call's output differs from one process by {d[call]:.3g} (relative; "
                         f"expected < {tol:g})" for call in ("first", "second") if not d[call] < tol]
            if d["bypassed"] != BYPASSED.get(name, 0):
                failures.append(f"{where}: {d['bypassed']} block call(s) ran without their hooks; expected "
                                f"{BYPASSED.get(name, 0)}")
        assert len(by_name) == len(TINY_VIDEO + OTHERS) or failures, (rank, by_name)
    assert not failures, "\n".join(failures)
