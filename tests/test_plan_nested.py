"""Plans over nested arguments and tuple outputs (issue 26 item 1).

``Split`` on a path into a nested tuple: diffusers' ``AllegroTransformer3DModel`` takes its RoPE as
``((cos, sin) per axis, positions per axis)``; the tables are indexed by position and stay whole, the three
position rows ``[1, L]`` follow the tokens: ``Split(("image_rotary_emb", 1), "O L", shard="L")`` splits each.
``Gather("out")`` on a block returning ``(video, text)`` (the project's ``JointDiT``): the block's tagged video is
gathered, the replicated text passes through. Oracle: the unmodified model on one process, fp64, N=2 and 4
(45 tokens, 3 heads). A path into something that is not a tuple is refused naming it.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

from dsp_plugin.plan import Block, Gather, Grid, Heads, Split
from tests.distributed import run_distributed

ALLEGRO_PLAN = {
    "": Split(("image_rotary_emb", 1), "O L", shard="L"),  # the positions; the (cos, sin) tables stay whole
    "transformer_blocks.0": Split("hidden_states", "B L D", shard="L"),
    "transformer_blocks.*": Block("B L D", arg="hidden_states"),
    "transformer_blocks.*.attn1": Heads(),
    "norm_out": Gather(0, "B L D"),
}


def _tiny_allegro() -> torch.nn.Module:
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(0)
    model = AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=3, attention_head_dim=12, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=36, sample_height=6, sample_width=6, sample_frames=5,
        caption_channels=16).double()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised tables would hide a path
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def _allegro_rope() -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], tuple[torch.Tensor, ...]]:
    """What ``AllegroPipeline._prepare_rotary_positional_embeddings`` passes for 5 x 3 x 3 tokens."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    *freqs, t, h, w = get_3d_rotary_pos_embed_allegro(embed_dim=12, crops_coords=((0, 0), (3, 3)), grid_size=(3, 3),
                                                      temporal_size=5)
    positions = torch.cartesian_prod(t.long(), h.long(), w.long()).reshape(-1, 3).transpose(0, 1)
    return tuple(freqs), tuple(positions.reshape(3, 1, -1).contiguous())


def _compare(reference: torch.nn.Module, model: torch.nn.Module, run: object) -> float:
    """Largest difference of output, input gradient and parameter gradients (summed over the group)."""
    from dsp_plugin import reduce_gradients

    results = []
    for m in (reference, model):
        out, x = run(m)  # type: ignore[operator]
        results.append((out.detach(), x.grad.clone(), {k: p.grad for k, p in m.named_parameters()
                                                       if p.grad is not None}))
    reduce_gradients(model.parameters())
    dist.all_reduce(results[1][1])
    (out_ref, dx_ref, g_ref), (out, dx, grads) = results
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == g_ref.keys(), sorted(set(grads) ^ set(g_ref))
    return max((out - out_ref).abs().max().item(), (dx - dx_ref).abs().max().item(),
               max((grads[k] - g_ref[k]).abs().max().item() for k in grads))


def _worker(rank: int, n: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin.testing.examples import JointDiT

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(4)
    result: dict[str, object] = {}
    latents, text, target = (torch.randn(2, 4, 5, 6, 6, generator=g), torch.randn(2, 7, 16, generator=g),
                             torch.randn(2, 4, 5, 6, 6, generator=g))
    rope = _allegro_rope()

    def allegro(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x = latents.clone().requires_grad_(True)
        out = m(x, text, torch.tensor([3, 700]), image_rotary_emb=rope, return_dict=False)[0]
        torch.nn.functional.mse_loss(out, target).backward()
        return out, x

    reference = _tiny_allegro()
    result["allegro"] = _compare(reference, dsp_plugin.parallelize(copy.deepcopy(reference), ALLEGRO_PLAN), allegro)

    video, words, t, target = (torch.randn(2, 5, 9, 4, generator=g), torch.randn(2, 7, 6, generator=g),
                               torch.rand(2, generator=g), torch.randn(2, 5, 9, 4, generator=g))

    def joint(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x = video.clone().requires_grad_(True)
        out = m(x, words, t)
        torch.nn.functional.mse_loss(out, target).backward()
        return out, x

    # the last block gathers its own output (video, text); the norm after it sees the whole video
    plan = {"": Grid(T=("video", 1)), "embed": Split("out", "B (T S) D", shard="T"),
            "blocks.*": Block("B (T S) D", arg="x"), "blocks.*.attn": Heads(joint="first"),
            "blocks.1": Gather("out", "B (T S) D")}
    result["gather_tuple"] = _compare(JointDiT(), dsp_plugin.parallelize(JointDiT(), plan), joint)
    bad = dsp_plugin.parallelize(_tiny_allegro(), ALLEGRO_PLAN | {"": Split(("image_rotary_emb", 1, 0, 0), "O L",
                                                                            shard="L")})
    try:
        bad(latents, text, torch.tensor([3, 700]), image_rotary_emb=rope)
        result["bad_path"] = "no error"
    except ValueError as exc:
        result["bad_path"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_nested_split_and_tuple_gather(n: int) -> None:
    pytest.importorskip("diffusers")
    for rank, d in enumerate(run_distributed(_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        assert d["allegro"] < 1e-9 and d["gather_tuple"] < 1e-9, (rank, d)
        assert d["bad_path"].startswith("ValueError: : Split(('image_rotary_emb', 1, 0, 0)): argument path "
                                        "('image_rotary_emb', 1, 0, 0): ('image_rotary_emb', 1, 0) is Tensor; "
                                        "expected a tuple or list"), d


def test_split_path_must_name_an_argument() -> None:
    with pytest.raises(ValueError, match=r"Split\(arg=\('out', 0\)\); expected a path"):
        Split(("out", 0), "O L", shard="L")
