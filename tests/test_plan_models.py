"""``dsp_plugin.parallelize`` on diffusers' Wan (full 3D, head switch) and Latte (factorized, folded rows).

Oracle: the unmodified diffusers model on one process, in fp64, on the same
weights and batch. 3 heads and 45 tokens (5 frames x 3x3 patches) on 2 and 4
ranks: uneven frames, uneven patches, and on 4 ranks one rank holds no head.
Output, input gradient and every parameter gradient summed over the group
(the project's convention) within 1e-9; the forward's collectives counted.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

import dsp_plugin  # noqa: E402
from dsp_plugin import reduce_gradients  # noqa: E402
from dsp_plugin.accounting import CommAccounting  # noqa: E402
from dsp_plugin.testing.tiny import tiny_latte, tiny_wan  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LAYERS = 2
# Wan's own blocks compute the adaLN modulation in fp32 (``temb.float()``, ``norm1(hidden_states.float())``) even
# in an fp64 model, so the gradients of the parameters before it (the time embedder, ~0.04) carry fp32
# rounding of the summation order: measured up to 1.3e-9 absolute (3e-8 relative). Everything else is fp64.
TOLERANCE = {"latte": {"out": 1e-9, "dx": 1e-9, "grads": 1e-9}, "wan": {"out": 1e-9, "dx": 1e-9, "grads": 5e-9}}


def _batch(model: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    channels = (4, 8) if model == "latte" else (4, 4)
    latents = torch.randn(2, channels[0], 5, 6, 6, generator=g, dtype=torch.float64)
    timestep = torch.tensor([3, 700])
    text = torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    target = torch.randn(2, channels[1], 5, 6, 6, generator=g, dtype=torch.float64)
    return latents, timestep, text, target


def _build(model: str) -> torch.nn.Module:
    if model == "latte":
        return tiny_latte(frames=5, layers=LAYERS, heads=3, head_dim=4, sample_size=6).double()
    return tiny_wan(layers=LAYERS, heads=3, head_dim=8).double()


def _run(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], ckpt: bool = False) -> tuple[torch.Tensor, ...]:
    latents, timestep, text, target = batch
    latents = latents.clone().requires_grad_(True)
    with CommAccounting(activations=False) as acct:
        out = model(latents, timestep, text, return_dict=False)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), latents.grad, grads, acct


def _parallel(rank: int, n: int, name: str) -> dict[str, float]:
    reference = _build(name)
    batch = _batch(name)
    out_ref, dx_ref, g_ref, _ = _run(reference, batch)
    result: dict[str, float] = {}
    for ckpt in (False, True):
        model = copy.deepcopy(reference)
        if ckpt:
            model.enable_gradient_checkpointing()
        parallel = dsp_plugin.parallelize(model)
        assert parallel is model
        out, dx, _, acct = _run(parallel, batch)
        reduce_gradients(model.parameters())
        dist.all_reduce(dx)
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == g_ref.keys(), sorted(set(grads) ^ set(g_ref))
        tag = "ckpt_" if ckpt else ""
        result |= {f"{tag}out": (out - out_ref).abs().max().item(), f"{tag}dx": (dx - dx_ref).abs().max().item(),
                   f"{tag}grads": max((grads[k] - g_ref[k]).abs().max().item() for k in grads)}
        if not ckpt:
            result |= {"fwd_all_to_all": acct.count("all_to_all", "forward"),
                       "fwd_all_gather": acct.count("all_gather", "forward"),
                       "fwd_collectives": acct.count(phase="forward")}
    return result


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", ["wan", "latte"])
def test_parallelize_equals_unmodified_model(name: str, n: int) -> None:
    for rank, d in enumerate(run_distributed(_parallel, n, name)):
        print(f"{name} n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
        for key in ("out", "dx", "grads", "ckpt_out", "ckpt_dx", "ckpt_grads"):
            assert d[key] < TOLERANCE[name][key.removeprefix("ckpt_")], f"{name} rank {rank}/{n}: {key} {d[key]:.3g}"
        # per layer: Wan one head switch there and one back (self-attention only; cross-attention local),
        # Latte one switch after each of its two blocks; the exit is one all_gather, the entry none
        assert d["fwd_all_to_all"] == 2 * LAYERS, d
        assert d["fwd_all_gather"] == 1, d


# The video DiTs of dsp_plugin.testing.tiny_video, found by class with no plan given. Each case: 3 heads (on 4 ranks
# one rank holds none), 2 samples, 45 video tokens (41 for Framepack's history + new frames; 54 for SkyReels-V2's
# causal blocks), uneven on 2 and 4 ranks; padded text of different lengths per sample where the model takes a mask.
VIDEO = ["tiny-hunyuan-video", "tiny-ltx-video", "tiny-ltx-video-per-token", "tiny-mochi", "tiny-skyreels-v2",
         "tiny-skyreels-v2-df", "tiny-skyreels-v2-causal", "tiny-easyanimate", "tiny-allegro", "tiny-consisid",
         "tiny-framepack"]
# Relative to the largest one-process value. fp64 models agree to rounding of the summation order over ranks
# (~1e-16). Where the model computes in fp32 whatever the dtype, that rounding is fp32's: Mochi (its norms and RoPE,
# ``.to(torch.float32)``), SkyReels-V2 (Wan's fp32 adaLN modulation), EasyAnimate (``apply_rotary_emb`` casts to
# fp32), ConsisID (its perceiver's fp32 softmax): measured up to 1.3e-7.
FP32_INSIDE = ("tiny-mochi", "tiny-skyreels-v2", "tiny-easyanimate", "tiny-consisid")
# attention modules under Heads per case (2 layers; HunyuanVideo, Framepack: 1 double- and 1 single-stream block);
# Mochi attends once per sample (its processor loops over the batch of 2): 2 head switches each
HEAD_SWITCHES = {name: 4 if name == "tiny-mochi" else 2 for name in VIDEO}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def _video(rank: int, n: int) -> dict[str, dict[str, float]]:
    from dsp_plugin.testing.tiny_video import case

    result = {}
    for name in VIDEO:
        reference, kwargs = case(name, torch.float64)
        model = dsp_plugin.parallelize(copy.deepcopy(reference))  # no plan: the built-in one for its class
        weight = None
        runs = []
        for m in (reference, model):
            x = kwargs["hidden_states"].clone().requires_grad_(True)
            with CommAccounting(activations=False) as acct:
                out = m(**{**kwargs, "hidden_states": x}, return_dict=False)[0]
                if weight is None:
                    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
                (out * weight).sum().backward()
            runs.append((out.detach(), x.grad, acct))
        (out_ref, dx_ref, _), (out, dx, acct) = runs
        reduce_gradients(model.parameters())
        dist.all_reduce(dx)
        grads = {k: (p.grad, q.grad) for (k, p), q in zip(model.named_parameters(), reference.parameters())}
        missing = [k for k, (g, r) in grads.items() if (g is None) != (r is None)]
        assert not missing, f"{name}: gradients present on one side only: {missing}"
        pairs = [(g, r) for g, r in grads.values() if r is not None]
        result[name] = {"out": _relative(out, out_ref), "dx": _relative(dx, dx_ref),
                        "grads": max((g - r).abs().max().item() for g, r in pairs)
                        / max(r.abs().max().item() for _, r in pairs),
                        "fwd_all_to_all": acct.count("all_to_all", "forward"),
                        "bwd_all_to_all": acct.count("all_to_all", "backward"),
                        "fwd_all_gather": acct.count("all_gather", "forward"),
                        "other": acct.count() - acct.count("all_to_all") - acct.count("all_gather", "forward")}
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_builtin_video_plans_equal_one_process(n: int) -> None:
    """One spawn per N looping over the models: output, input gradient and every parameter gradient (summed)."""
    for rank, by_name in enumerate(run_distributed(_video, n, timeout=600)):
        for name, d in by_name.items():
            print(f"{name} n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
            tol = 1e-6 if name.startswith(FP32_INSIDE) else 1e-12
            for key in ("out", "dx", "grads"):
                assert d[key] < tol, f"{name} rank {rank}/{n}: {key} {d[key]:.3g} (relative)"
            # per attention: one all-to-all to heads and one back (the text joins inside them), the adjoints the
            # same in backward; one all_gather at exit, its adjoint local; nothing else
            switches = HEAD_SWITCHES[name]
            assert (d["fwd_all_to_all"], d["bwd_all_to_all"]) == (2 * switches, 2 * switches), (name, d)
            assert (d["fwd_all_gather"], d["other"]) == (1, 0), (name, d)


def test_hunyuan_video_token_replace_is_refused_naming_why() -> None:
    """HunyuanVideo I2V (``image_condition_type="token_replace"``) modulates its blocks' first tokens by position:
    on a shard, every rank's own first tokens. The built-in plan refuses it at ``parallelize``, before any
    collective (no process group here)."""
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4), image_condition_type="token_replace")
    with pytest.raises(ValueError, match=r"image_condition_type='token_replace'.*first_frame_num_tokens.*expected "
                                         r"image_condition_type None or 'latent_concat'"):
        dsp_plugin.parallelize(model)


def _nabla(rank: int, n: int) -> list[str]:
    from dsp_plugin.testing.tiny_video import case

    reference, kwargs = case("tiny-kandinsky5", torch.float32)
    model = dsp_plugin.parallelize(copy.deepcopy(reference))
    sparse = {"sta_mask": torch.ones(1, 1, dtype=torch.bool), "P": 0.9, "to_fractal": False}
    seen = []
    for _ in range(2):   # refused again at the next call: nothing was left half done
        with pytest.raises(ValueError) as err:
            model(**kwargs, sparse_params=sparse, return_dict=False)
        seen.append(str(err.value))
    with torch.no_grad():  # dense attention still runs, equal to one process
        out = model(**kwargs, return_dict=False)[0]
        seen.append(str((out - reference(**kwargs, return_dict=False)[0]).abs().max().item()))
    return seen


def test_kandinsky5_nabla_sparse_attention_is_refused_on_every_rank_naming_why() -> None:
    """Kandinsky 5's NABLA attention (``sparse_params``) builds its block mask from means over 64-token blocks of
    the whole sequence inside the processor; on a shard it would see this rank's tokens (diffusers then fails on a
    shape mismatch against the global ``sta_mask``). ``kandinsky5_plan`` refuses the argument at the first visual
    block (``Block(refuse=...)``), on every rank, before any collective, and again at the next call; a dense call
    after it runs as before."""
    for rank, (first, again, dense) in enumerate(run_distributed(_nabla, 2, timeout=120)):
        for message in (first, again):
            assert message.startswith("visual_transformer_blocks.0: the call passes sparse_params, which this plan "
                                      "cannot serve: NABLA sparse attention") and \
                message.endswith("expected sparse_params=None"), (rank, message)
        assert float(dense) < 1e-5, (rank, dense)
    with pytest.raises(ValueError, match=r"Block\(refuse=\{'sparse_params': ''\}\); expected \{argument name: why"):
        dsp_plugin.plan.Block("B L D", refuse={"sparse_params": ""})


# The video transformers diffusers 0.42.1 added beside the ones above, each found by class with no plan given
# (dsp_plugin.testing.tiny_video's CASES: 3 heads, 2 samples, 45 video tokens, uneven on 2 and 4 ranks, padded text
# where the model takes a text mask; Wan VACE, Wan Animate on whole frames: 3+2 and 2+1+1+1), each run without and
# under the model's own gradient checkpointing against the unmodified model on one process, in fp64 (Cosmos with its
# _keep_in_fp32_modules in fp32: it fails without). Kandinsky 5 and Motif-Video run in fp32: their time embeddings
# feed fp32 to layers of the model's dtype, so they fail in fp64. Every output of the model is compared (LTX-2,
# Kandinsky 6, MiniMax-H3: video and audio), the input gradient of hidden_states, every parameter gradient summed.
NEW = ["tiny-wan-vace", "tiny-wan-animate", "tiny-chronoedit", "tiny-anyflow", "tiny-minimax-h3", "tiny-ltx2",
       "tiny-cosmos", "tiny-kandinsky5", "tiny-kandinsky6", "tiny-motif-video", "tiny-hunyuan-video15", "tiny-helios",
       "tiny-sana-video"]
NEW_DTYPE = {"tiny-kandinsky5": torch.float32, "tiny-motif-video": torch.float32}
# relative differences allowed: 1e-12 for HunyuanVideo 1.5 (fp64 throughout); 1e-6 where the model computes parts in
# fp32 whatever its dtype (Wan's fp32 adaLN modulation in Wan VACE, Wan Animate, ChronoEdit, AnyFlow, Helios;
# diffusers' RMSNorm's fp32 variance in LTX-2; MiniMax-H3's fp32 RoPE and heads; Cosmos' fp32 positions;
# Kandinsky 6's fp32 RoPE and modulation; SanaVideo's fp32 linear attention), 1e-5 for the two run in fp32 (measured
# up to 1.6e-7)
NEW_TOLERANCE = {name: 1e-5 if name in NEW_DTYPE else 1e-12 if name == "tiny-hunyuan-video15" else 1e-6
                 for name in NEW}
# (forward all-to-alls, forward all_gathers, backward reduce-scatters) per case, the backward's all-to-alls as many
# as the forward's: 2 per attention under Heads (Wan VACE: 2 main and 2 control blocks; Motif-Video: 1 dual, 1
# single, 1 decoder block), 1 all_gather at exit (its backward local); LTX-2 and Kandinsky 6: 1 all_gather per layer
# of the video keys its audio queries read (video-to-audio), Motif-Video: 1 of the encoder's output its decoder reads,
# each with a reduce-scatter backward; HunyuanVideo 1.5: 1 all_gather per attention of the video entries of the mask
# its processor builds from a rank's tokens (no gradient); SanaVideo: per layer 3 all-to-alls for q, k, v and 1 back
# around its linear attention, 2 around its feed-forward's temporal convolution
NEW_COLLECTIVES = {"tiny-wan-vace": (8, 1, 0), "tiny-wan-animate": (8, 1, 0), "tiny-ltx2": (4, 3, 2),
                   "tiny-kandinsky6": (4, 3, 2), "tiny-motif-video": (6, 2, 1), "tiny-hunyuan-video15": (4, 3, 0),
                   "tiny-sana-video": (12, 1, 0)}
# backward all-to-alls under the model's gradient checkpointing where they differ: SanaVideo's recompute issues the
# switch after its temporal convolution again (one per layer) instead of replaying it
CKPT_BACKWARD = {"tiny-sana-video": 14}


def forward_backward(reference: torch.nn.Module, model: torch.nn.Module, kwargs: dict,
                     call: Any) -> tuple[tuple[list, torch.Tensor], tuple[list, torch.Tensor, CommAccounting]]:
    """``call(m, kwargs)`` (a list of output tensors) on ``reference`` then ``model``, each with its own copy of
    ``kwargs["hidden_states"]`` requiring grad, and backward of the outputs weighted by the same random tensors.
    Returns ``(outputs, input gradient)`` of the reference and ``(outputs, input gradient, accounting)`` of the
    model, whose parameter gradients and input gradient are summed over the group."""
    runs, weights = [], None
    for m in (reference, model):
        x = kwargs["hidden_states"].clone().requires_grad_(True)
        with CommAccounting(activations=False) as acct:
            outs = call(m, {**kwargs, "hidden_states": x})
            if weights is None:
                g = torch.Generator().manual_seed(9)
                weights = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
            sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        runs.append(([o.detach() for o in outs], x.grad, acct))
    (outs_ref, dx_ref, _), (outs, dx, acct) = runs
    reduce_gradients(model.parameters())
    dist.all_reduce(dx)
    return (outs_ref, dx_ref), (outs, dx, acct)


def _one(name: str, reference: torch.nn.Module, kwargs: dict, ckpt: bool) -> dict[str, float]:
    """``name``'s model parallelized by its built-in plan against ``reference`` (fp64): relative differences of
    every output, the input gradient, every parameter gradient (summed over the group), and the collectives."""
    model = copy.deepcopy(reference)
    if ckpt:
        model.enable_gradient_checkpointing()
    model = dsp_plugin.parallelize(model)  # no plan: the built-in one for its class
    (outs_ref, dx_ref), (outs, dx, acct) = forward_backward(
        reference, model, kwargs, lambda m, kw: [o for o in m(**kw, return_dict=False) if o is not None])
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    missing = [i for i, (g, r) in enumerate(pairs) if (g is None) != (r is None)]
    assert not missing, f"{name}: gradients present on one side only: parameters {missing}"
    pairs = [(g, r) for g, r in pairs if r is not None]
    for p in reference.parameters():
        p.grad = None
    return {"out": max(_relative(o, r) for o, r in zip(outs, outs_ref)), "dx": _relative(dx, dx_ref),
            "grads": max((g - r).abs().max().item() for g, r in pairs) / max(r.abs().max().item() for _, r in pairs),
            "fwd_all_to_all": acct.count("all_to_all", "forward"),
            "bwd_all_to_all": acct.count("all_to_all", "backward"),
            "fwd_all_gather": acct.count("all_gather", "forward"),
            "bwd_reduce_scatter": acct.count("reduce_scatter", "backward"),
            "other": acct.count() - acct.count("all_to_all") - acct.count("all_gather", "forward")
            - acct.count("reduce_scatter", "backward")}


def _new_video(rank: int, n: int, names: list[str]) -> dict[str, dict[str, float]]:
    from dsp_plugin.testing.tiny_video import case

    result = {}
    for name in names:
        start = time.perf_counter()
        reference, kwargs = case(name, NEW_DTYPE.get(name, torch.float64))
        plain = _one(name, reference, kwargs, ckpt=False)
        ckpt = _one(name, reference, kwargs, ckpt=True)
        result[name] = plain | {f"ckpt_{k}": v for k, v in ckpt.items()} | {"seconds": time.perf_counter() - start}
    return result


# every case on 2 ranks, in two runs, and on 4 ranks (45 tokens: 12+11+11+11; 3 heads: rank 3 holds none) in two runs:
# HunyuanVideo 1.5 (padded text: sample 0's mask, the mask its processor builds from a rank's tokens laid out for the
# global sequence) and SanaVideo (the head switch at its projections, its temporal convolution's switches, their
# recompute) in one, every other case in the other; each with and without the model's own gradient checkpointing
NEW_RUNS = {"2-wan-family": (2, NEW[:6] + ["tiny-helios"]),
            "2-more-families": (2, [name for name in NEW[6:] if name != "tiny-helios"]),
            "4-mask-and-projections": (4, ["tiny-hunyuan-video15", "tiny-sana-video"]),
            "4-the-others": (4, [name for name in NEW if name not in ("tiny-hunyuan-video15", "tiny-sana-video")])}


@pytest.mark.parametrize("run", list(NEW_RUNS))
def test_new_video_plans_equal_one_process(run: str) -> None:
    """One run over its cases: outputs, input gradient and every parameter gradient (summed), without and under the
    model's own gradient checkpointing, whose recompute replays the kept collectives."""
    n, names = NEW_RUNS[run]
    for rank, by_name in enumerate(run_distributed(_new_video, n, names, timeout=300)):
        for name, d in by_name.items():
            print(f"{name} n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
            for key in ("out", "dx", "grads", "ckpt_out", "ckpt_dx", "ckpt_grads"):
                assert d[key] < NEW_TOLERANCE[name], f"{name} rank {rank}/{n}: {key} {d[key]:.3g} (relative)"
            a2a, gathers, scatters = NEW_COLLECTIVES.get(name, (4, 1, 0))
            for tag in ("", "ckpt_"):
                got = tuple(d[f"{tag}{k}"] for k in ("fwd_all_to_all", "bwd_all_to_all", "fwd_all_gather",
                                                     "bwd_reduce_scatter", "other"))
                backward = CKPT_BACKWARD.get(name, a2a) if tag else a2a
                assert got == (a2a, backward, gathers, scatters, 0), (name, tag, d)


def test_video_transformers_no_plan_serves_are_refused_naming_why() -> None:
    """No processes: each video transformer of diffusers 0.42.1 without a built-in plan is refused at
    ``parallelize``, naming the class and what in it no plan of this release serves, before any hook (an empty
    module of the class: its configuration does not matter to the refusal)."""
    import diffusers

    from dsp_plugin.plan.builtin.refused import REFUSED

    assert sorted(REFUSED) == ["AnyFlowFARTransformer3DModel", "Cosmos3OmniTransformer",
                               "Kandinsky6SRTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel",
                               "SanaWMTransformer3DModel", "WanAnimate2Transformer3DModel"]
    for name in REFUSED:
        cls = getattr(diffusers, name)
        model = cls.__new__(cls)
        torch.nn.Module.__init__(model)
        with pytest.raises(ValueError, match=rf"^parallelize: no built-in plan for {name}: its .* Pass plan= of your "
                                             rf"own"):
            dsp_plugin.parallelize(model)
