"""Attention masks through the head switch (issue 26 item 1, issue 25 item 3).

A mask built for the global sequence is right for the attention after the switch (full sequence, this rank's
heads): key padding ``[B, 1, 1, Lk]`` and ``[B, Lk]`` (HunyuanVideo's text mask, joint tokens last), per-head
additive biases ``[1, H, Lq, Lk]`` and ``[H, Lq, Lk]``, block-causal ``[Lq, Lk]`` (SkyReels-V2's causal blocks),
through SDPA and through diffusers' dispatch. Oracle: the same model on one process, fp64; N=2 and 4 over 10
tokens (uneven; on 4 one rank holds no head), output, input gradient and parameter gradients summed over the
group. Then a tiny diffusers ``HunyuanVideoTransformer3DModel`` (padded text, a different length per sample)
with a plan of six entries. A mask the model builds from the tokens a rank sees (the local length), with one
token per rank (where it used to broadcast silently) and with more (a size error that differed per rank), and a
mask whose head dim is neither H nor 1, are refused on every rank, naming the shape. Under ``sharded_io`` (the
model fed its shard) a key-padding mask built from the shard is laid out by gathering its video key columns,
once per forward; one with a query dim is refused on every rank.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed

HEADS, DIM, TOKENS, TEXT = 3, 18, 10, 4


class MaskedAttention(nn.Module):
    """Self-attention over ``x`` (and ``text`` after it) with the caller's mask, through SDPA or dispatch.

    ``local_mask``: the module builds its own additive key mask from the tokens it sees (the last key
    penalised), the mistake a model makes when it sizes a mask by its input.
    """

    def __init__(self, via: str, local_mask: bool = False) -> None:
        super().__init__()
        self.via, self.local_mask = via, local_mask
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, text: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
        h = x if text is None else torch.cat([x, text], dim=1)
        q, k, v = (t.unflatten(-1, (HEADS, -1)) for t in self.qkv(h).chunk(3, dim=-1))  # [B, L, H, Dh]
        if self.local_mask:
            mask = torch.zeros(h.shape[0], 1, 1, h.shape[1], dtype=h.dtype)
            mask[..., -1] = -2.0
        if self.via == "sdpa":
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
            out = out.transpose(1, 2)
        else:
            from diffusers.models.attention_dispatch import dispatch_attention_fn

            out = dispatch_attention_fn(q, k, v, attn_mask=mask)
        out = self.proj(out.flatten(2))
        return out[:, :x.shape[1]], out[:, x.shape[1]:]


class MaskedBlock(nn.Module):
    def __init__(self, via: str, local_mask: bool) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(DIM), MaskedAttention(via, local_mask)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, text: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[
            torch.Tensor, torch.Tensor | None]:
        a, t = self.attn(self.norm(x), text, mask)
        x = x + a
        return x + self.mlp(x), (None if text is None else text + t)


class MaskedDiT(nn.Module):
    """``video [B, L, 4]``, ``text [B, R, 4]`` or None, ``mask`` for the R + L tokens -> ``[B, L, 4]``.

    ``built``: the model builds one mask per forward from the video tokens it is fed, as HunyuanVideo does, and
    passes it to every block: ``"padding"`` a bool key-padding mask ``[B, 1, 1, L + R]`` (sample 0's text 2
    tokens shorter), ``"rows"`` an additive ``[B, 1, L + R, L + R]`` (a query dim)."""

    def __init__(self, via: str, local_mask: bool = False, layers: int = 2, built: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.built = built
        self.embed, self.text_embed = nn.Linear(4, DIM), nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(MaskedBlock(via, local_mask) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 4)

    def forward(self, video: torch.Tensor, text: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x, context = self.embed(video), None if text is None else self.text_embed(text)
        keys = x.shape[1] + (0 if text is None else text.shape[1])
        if self.built == "padding":
            mask = torch.ones(x.shape[0], 1, 1, keys, dtype=torch.bool)
            mask[0, ..., -2:] = False
        elif self.built == "rows":
            mask = torch.zeros(x.shape[0], 1, keys, keys)
        for block in self.blocks:
            x, context = block(x, context, mask)
        return self.out(self.norm(x))


def _plan(joint: str | None) -> dict[str, object]:
    from dsp_plugin.plan import Block, Gather, Heads, Split

    return {"blocks.0": Split("x", "B L D", shard="L"), "blocks.*": Block("B L D", arg="x"),
            "blocks.*.attn": Heads(joint=joint), "norm": Gather(0, "B L D")}


def _masks(g: torch.Generator) -> dict[str, tuple[bool, torch.Tensor]]:
    """name -> (joint text, the mask for the global sequence)."""
    joint = TOKENS + TEXT
    padding = torch.ones(2, joint, dtype=torch.bool)
    padding[0, -2:] = False                                       # sample 0's text is 2 tokens shorter
    frames = torch.arange(TOKENS) // 2                            # 5 frames of 2 tokens: block-causal
    causal = frames[:, None] >= frames[None, :]
    bias = torch.randn(1, HEADS, joint, joint, generator=g, dtype=torch.float64)
    return {"padding_4d": (True, padding[:, None, None]), "padding_2d": (True, padding),
            "head_bias_4d": (True, bias.masked_fill(~padding[:1, None, None], float("-inf"))),
            "head_bias_3d": (False, bias[0, :, :TOKENS, :TOKENS]), "causal_blocks_2d": (False, causal)}


def _run(model: nn.Module, video: torch.Tensor, text: torch.Tensor | None, mask: torch.Tensor,
         target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    video = video.clone().requires_grad_(True)
    out = model(video, text, mask)
    F.mse_loss(out, target).backward()
    return out.detach(), video.grad, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _masks_worker(rank: int, n: int) -> dict[str, object]:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    import dsp_plugin
    from dsp_plugin import reduce_gradients

    logging.getLogger("diffusers").setLevel(logging.ERROR)  # checks on: "Removing unsupported arguments"
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(3)
    video, text, target = (torch.randn(2, TOKENS, 4, generator=g), torch.randn(2, TEXT, 4, generator=g),
                           torch.randn(2, TOKENS, 4, generator=g))
    result: dict[str, object] = {}
    for kind, (joint, mask) in _masks(g).items():
        for via, checked in (("sdpa", False), ("dispatch", False), ("dispatch", True)):
            if kind == "padding_2d" and via == "sdpa":
                continue  # SDPA reads a 2-D mask as [Lq, Lk]; the [B, Lk] form is diffusers' (its backends convert)
            if checked and kind != "padding_4d":
                continue
            # DIFFUSERS_ATTN_CHECKS=1: diffusers' shape check runs after the switch, on what the kernel sees
            _AttentionBackendRegistry._checks_enabled = checked
            reference = MaskedDiT(via)
            model = dsp_plugin.parallelize(MaskedDiT(via), _plan("last" if joint else None))
            out_ref, dx_ref, g_ref = _run(reference, video, text if joint else None, mask, target)
            out, dx, grads = _run(model, video, text if joint else None, mask, target)
            reduce_gradients(model.parameters())
            dist.all_reduce(dx)
            grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
            result[f"{kind}/{via}" + ("_checked" if checked else "")] = max(
                (out - out_ref).abs().max().item(), (dx - dx_ref).abs().max().item(),
                max((grads[k] - g_ref[k]).abs().max().item() for k in g_ref))
    _AttentionBackendRegistry._checks_enabled = False
    # refused on every rank: a mask sized by the local tokens (one token per rank, and more), a head dim of 2
    for via in ("sdpa", "dispatch"):
        model = dsp_plugin.parallelize(MaskedDiT(via, local_mask=True), _plan(None))
        for tokens in (n, TOKENS):
            result[f"local/{via}/{tokens}"] = _error(lambda m=model, t=tokens: m(torch.randn(2, t, 4)))
        model = dsp_plugin.parallelize(MaskedDiT(via), _plan(None))
        result[f"two_heads/{via}"] = _error(lambda m=model: m(video, None, torch.zeros(1, 2, TOKENS, TOKENS)))
    result["hunyuan"] = _hunyuan(rank, n)
    result |= _built_from_shard(video, text)
    dist.barrier()
    return result


def _built_from_shard(video: torch.Tensor, text: torch.Tensor) -> dict[str, object]:
    """Under ``sharded_io`` the model is fed its shard and builds its mask from it (``R + L_local`` keys): a
    key-padding one is laid out by one all_gather of its video key columns per forward (both blocks get the same
    object); one with a query dim is refused on every rank, naming its shape."""
    import dsp_plugin
    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.comm import gather, split
    from dsp_plugin.plan import sharded_io

    result: dict[str, object] = {}
    for via in ("sdpa", "dispatch"):
        expected = MaskedDiT(via, built="padding")(video, text)
        model = dsp_plugin.parallelize(MaskedDiT(via, built="padding"), _plan("last"))
        with CommAccounting(activations=False) as acct, sharded_io(L=TOKENS):
            out = model(split(video, 1), text)
        result[f"io/{via}"] = (gather(out, 1, global_len=TOKENS) - expected).abs().max().item()
        result[f"io/{via}/ops"] = [r.op for r in acct.records]
        model = dsp_plugin.parallelize(MaskedDiT(via, built="rows"), _plan("last"))
        with sharded_io(L=TOKENS):
            result[f"io_rows/{via}"] = _error(lambda m=model: m(split(video, 1), text))
    result["io_layouts"] = _gather_key_padding_layouts()
    return result


def _gather_key_padding_layouts() -> float:
    """``gather_key_padding`` itself: 5 frames of 2 tokens sharded on frames (a folded sequence axis), text
    first or last, the mask built from the shard or for the whole sequence -> the global mask, exactly."""
    from dsp_plugin.comm import chunk_sizes, group_rank, group_size
    from dsp_plugin.packing import offsets
    from dsp_plugin.plan.masks import gather_key_padding

    n, rank = group_size(None), group_rank(None)
    frames, per_frame, text = 5, 2, 3
    local = chunk_sizes(frames, n)[rank]
    start = offsets(chunk_sizes(frames, n))[rank] * per_frame
    g = torch.Generator().manual_seed(7)
    video = torch.rand(2, 1, 1, frames * per_frame, generator=g) > 0.3
    words = torch.rand(2, 1, 1, text, generator=g) > 0.3
    worst = 0.0
    for joint in ("first", "last"):
        whole = torch.cat((words, video) if joint == "first" else (video, words), dim=-1)
        mine = video[..., start:start + local * per_frame]
        for mask in (torch.cat((words, mine) if joint == "first" else (mine, words), dim=-1), whole):
            out = gather_key_padding(mask, lengths=[(local, frames), (per_frame, per_frame)], axis=0, count=text,
                                     joint=joint, group=None)
            worst = max(worst, float(out.shape != whole.shape or out.dtype != whole.dtype or (out != whole).any()))
    return worst


def _tiny_hunyuan() -> nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=False, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4))
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised gates would hide the blocks
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def _hunyuan(rank: int, n: int) -> float:
    """HunyuanVideo with its own text mask (joint tokens last), the plan written here from docs/models.md."""
    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.plan import Block, Gather, Grid, Heads, Split

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    video = "B (F HW) D"
    plan = {"": Grid(F=("hidden_states", 2)), "rope": Split("out", "(F HW) K", shard="F"),
            "transformer_blocks.0": Split("hidden_states", video, shard="F"),  # after the model sized its mask
            "transformer_blocks.*": Block(video, arg="hidden_states"),
            "single_transformer_blocks.*": Block(video, arg="hidden_states"),
            "transformer_blocks.*.attn": Heads(joint="last"), "single_transformer_blocks.*.attn": Heads(joint="last"),
            "norm_out": Gather(0, video)}
    reference = _tiny_hunyuan().double()
    model = dsp_plugin.parallelize(_tiny_hunyuan().double(), plan)
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(2, 4, 5, 6, 6, generator=g), torch.randn(2, 7, 16, generator=g)
    text_mask = torch.ones(2, 7)
    text_mask[0, 4:] = 0  # padded text: 4 tokens in sample 0, 7 in sample 1
    pooled, target = torch.randn(2, 8, generator=g), torch.randn(2, 4, 5, 6, 6, generator=g)
    runs = []
    for m in (reference, model):
        x = latents.clone().requires_grad_(True)
        out = m(x, torch.tensor([3, 700]), text, text_mask, pooled, return_dict=False)[0]
        F.mse_loss(out, target).backward()
        runs.append((out.detach(), x.grad))
    reduce_gradients(model.parameters())
    dist.all_reduce(runs[1][1])
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
                if q.grad is not None)
    return max((runs[1][0] - runs[0][0]).abs().max().item(), (runs[1][1] - runs[0][1]).abs().max().item(), grads)


@pytest.mark.parametrize("n", [2, 4])
def test_masks_through_heads(n: int) -> None:
    pytest.importorskip("diffusers")
    for rank, d in enumerate(run_distributed(_masks_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        for key, value in d.items():
            if isinstance(value, float):
                assert value < 1e-9, (rank, key, value)
        for via in ("sdpa", "dispatch"):
            for tokens in (n, TOKENS):
                message = d[f"local/{via}/{tokens}"]
                assert message.startswith("CrossRankMismatch") and "this rank's own tokens" in message, message
                assert "attention mask of shape (2, 1, 1, " in message and f"expected a mask for the global " \
                       f"sequence: last dim {tokens} keys" in message, message
            assert d[f"io/{via}/ops"] == ["all_to_all", "all_gather"] + ["all_to_all"] * 3, d[f"io/{via}/ops"]
            message = d[f"io_rows/{via}"]
            assert message.startswith("CrossRankMismatch") and "under sharded_io an attention mask of shape " \
                "(2, 1, " in message and "only a key-padding mask (query dim 1" in message, message
            message = d[f"two_heads/{via}"]
            assert message.startswith("CrossRankMismatch") and f"(1, 2, {TOKENS}, {TOKENS}) has 2 on dim 1" \
                in message, message
