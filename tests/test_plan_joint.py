"""Joint attention: text tokens replicated on every rank, through the head switch (``Heads(joint=...)``).

Oracle: the unmodified ``JointDiT`` (``dsp_plugin.testing.examples``) on one process, in fp64, on the same
weights and batch: 3 heads, 5 frames x 9 patches (uneven frames on 2 and 4 ranks; on 4 one rank holds no
head), 7 text tokens before the video tokens (CogVideoX) or after them (SD3). docs/models.md's plan runs as
printed. Output, the video and the text input gradients and every parameter gradient summed over the group
(the project's convention) within 1e-9; two SGD steps equal to one process; the collectives of one forward
and backward counted; the text output's bytes packed into the all-to-all against a separate all_gather
over heads, measured; a text-token count that differs across ranks fails on every rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsp_plugin import comm, reduce_gradients
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.checks import check_mode
from dsp_plugin.head_switch import head_ranges
from dsp_plugin.plan import Block, Heads, Split
from dsp_plugin.testing.examples import Attention, JointDiT
from tests.distributed import assert_no_steady_state_checks, run_distributed

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS, TEXT, HEAD_DIM = 2, 3, 7, 6   # JointDiT's defaults: 2 blocks, dim 18 = 3 heads x 6


def _doc_block() -> str:
    text = (ROOT / "docs/models.md").read_text()
    section = text[text.index("### Joint attention"):text.index("## Adapters")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_doc_plan_is_short() -> None:
    plan = re.search(r"_PLAN = \{\n(.*?)\n\}", _doc_block(), flags=re.S)
    assert plan is not None and len(plan.group(1).splitlines()) + 2 <= 20


def test_heads_rejects_an_unknown_place() -> None:
    with pytest.raises(ValueError, match="expected None, 'first' or 'last'"):
        Heads(joint="middle")


def _batch(seed: int, text_len: int = TEXT) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, 9, 4, generator=g), torch.randn(2, text_len, 6, generator=g),
            torch.rand(2, generator=g), torch.randn(2, 5, 9, 4, generator=g))


def _run(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[object, ...]:
    video, text, t, target = batch
    video, text = video.clone().requires_grad_(True), text.clone().requires_grad_(True)
    with CommAccounting(activations=False) as acct:
        out = model(video, text, t)
        torch.nn.functional.mse_loss(out, target).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), video.grad, text.grad, grads, acct


def _worker(rank: int, n: int) -> dict[str, object]:
    torch.set_default_dtype(torch.float64)
    scope: dict = {"__name__": "__docs__"}
    exec(compile(_doc_block(), "docs/models.md", "exec"), scope)  # noqa: S102 - our own docs; asserts the output
    import dsp_plugin

    result: dict[str, object] = {}
    models = {"first": scope["model"]}
    plan_last = dict(scope["JOINT_PLAN"]) | {"blocks.*.attn": Heads(joint="last")}
    models["last"] = dsp_plugin.parallelize(JointDiT(text_first=False), plan_last)
    for where, model in models.items():
        reference = JointDiT(text_first=where == "first")
        model.zero_grad()
        batch = _batch(1)
        out_ref, dv_ref, dt_ref, g_ref, _ = _run(reference, batch)
        out, dv, dt, _, acct = _run(model, batch)
        reduce_gradients(model.parameters())
        dist.all_reduce(dv)
        dist.all_reduce(dt)
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == g_ref.keys(), sorted(set(grads) ^ set(g_ref))
        result |= {f"{where}_out": (out - out_ref).abs().max().item(),
                   f"{where}_dvideo": (dv - dv_ref).abs().max().item(),
                   f"{where}_dtext": (dt - dt_ref).abs().max().item(),
                   f"{where}_grads": max((grads[k] - g_ref[k]).abs().max().item() for k in grads),
                   f"{where}_counts": {f"{op}/{phase}": acct.count(op, phase) for op in ("all_to_all", "all_gather")
                                       for phase in ("forward", "backward")} | {"all/all": acct.count()}}
    # the text output's bytes: packed into from_heads' all-to-all (this rank's heads of it to every rank)
    # against a separate all_gather of it over heads (uneven head chunks padded), per forward of LAYERS blocks
    model = models["first"]
    sent = []
    for text_len in (TEXT, 0):
        with CommAccounting(activations=False) as acct:
            model(*_batch(2, text_len)[:3])
        sent.append(acct.bytes_sent("all_to_all", "forward"))
    mine = head_ranges(HEADS, n)[rank][1]
    with CommAccounting(activations=False) as acct:
        for _ in range(LAYERS):
            comm.gather(torch.zeros(2, mine, TEXT, HEAD_DIM), 1, global_len=HEADS)
    result |= {"packed_text_bytes": sent[0] - sent[1], "all_gather_text_bytes": acct.bytes_sent("all_gather"),
               "all_gather_text_count": acct.count("all_gather"), "packed_text_expected":
               LAYERS * (n - 1) * 2 * mine * TEXT * HEAD_DIM * 8}
    # two SGD steps with nothing in the loop but reduce_gradients
    reference = JointDiT()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    for step in range(2):
        video, text, t, target = _batch(10 + step)
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            with CommAccounting(activations=False) as acct:
                torch.nn.functional.mse_loss(m(video, text, t), target).backward()
            if m is model:
                reduce_gradients(m.parameters())
                checks = acct.check_records
            o.step()
    assert_no_steady_state_checks(checks, check_mode(), "the joint model's second step")  # lengths all known
    result["trained"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    # a text-token count that differs across ranks (3 + rank, never seen before): the same error everywhere
    video, text, t, _ = _batch(3, 3 + rank)
    try:
        model(video, text, t)
        result["mismatch"] = "no error"
    except ValueError as exc:
        result["mismatch"] = f"{type(exc).__name__}: {exc}"
    # rank 0's attention holds one token fewer than its shard: its own error, raised on every rank
    short = dsp_plugin.parallelize(_Short(), {"block": [Split("x", "B L D", shard="L"), Block("B L D", arg="x")],
                                              "block.attn": Heads(joint="last")})
    try:
        short(torch.randn(2, 9, 18))
        result["short"] = "no error"
    except ValueError as exc:
        result["short"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return result


class _ShortBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(18, HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x[:, 1:] if dist.get_rank() == 0 else x)


class _Short(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _ShortBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@pytest.mark.parametrize("n", [2, 4])
def test_joint_attention_equals_one_process(n: int) -> None:
    for rank, d in enumerate(run_distributed(_worker, n)):
        print(f"n={n} rank {rank}: {d}")
        for where in ("first", "last"):
            for key in ("out", "dvideo", "dtext", "grads"):
                assert d[f"{where}_{key}"] < 1e-9, (rank, where, key, d)
            # per joint attention: to heads 1 + back 1 (the text output packed in); the exit's all_gather
            assert d[f"{where}_counts"] == {"all_to_all/forward": 2 * LAYERS, "all_to_all/backward": 2 * LAYERS,
                                            "all_gather/forward": 1, "all_gather/backward": 0,
                                            "all/all": 4 * LAYERS + 1}, d
        assert d["trained"] < 1e-9, d
        assert d["packed_text_bytes"] == d["packed_text_expected"], d
        assert d["all_gather_text_count"] == LAYERS and d["all_gather_text_bytes"] >= d["packed_text_bytes"], d
        assert d["short"].startswith("CrossRankMismatch") and "rank(s) [0]" in d["short"] \
            and "expects the replicated tokens plus this rank's" in d["short"], d
        # the parallelized model's entry check (InputMismatch) now refuses the differing text before the head
        # switch's own count check (CrossRankMismatch) is reached; either names what differs, on every rank
        assert (d["mismatch"].startswith("InputMismatch") and "the inputs differ across" in d["mismatch"]
                and "text (alike on ranks" in d["mismatch"]) or (
            d["mismatch"].startswith("CrossRankMismatch") and "count of replicated tokens" in d["mismatch"]
            and all(f"{3 + r} on rank {r}" in d["mismatch"] for r in range(n))), d


def _tiny_cogvideox(rope: bool) -> torch.nn.Module:
    """A diffusers ``CogVideoXTransformer3DModel``: 3 heads of 16, 2 layers, patch 2, 7 text tokens; random weights."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=LAYERS, sample_width=6, sample_height=6, sample_frames=17, patch_size=2,
        max_text_seq_length=TEXT, use_rotary_positional_embeddings=rope).double()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised tables would hide a path
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def _cogvideox_worker(rank: int, n: int) -> dict[str, object]:
    import copy

    import dsp_plugin

    torch.set_default_dtype(torch.float64)
    result: dict[str, object] = {}
    g = torch.Generator().manual_seed(4)
    latents, text = torch.randn(2, 5, 4, 6, 6, generator=g), torch.randn(2, TEXT, 16, generator=g)
    timestep, target = torch.tensor([3, 700]), torch.randn(2, 5, 4, 6, 6, generator=g)
    # CogVideoX 5b's 3D RoPE: the pipeline passes (cos, sin) for the 5 x 3 x 3 video tokens
    tables = (torch.randn(45, 16, generator=g), torch.randn(45, 16, generator=g))
    for rope, ckpt in ((False, False), (True, False), (True, True)):
        reference = _tiny_cogvideox(rope)
        model = copy.deepcopy(reference)
        if ckpt:  # the model's own gradient checkpointing: its recompute must not rerun the head switches
            model.enable_gradient_checkpointing()
        model = dsp_plugin.parallelize(model)   # the built-in plan, found from the class
        kwargs = {"image_rotary_emb": tables} if rope else {}
        runs = []
        for m in (reference, model):
            x, e = latents.clone().requires_grad_(True), text.clone().requires_grad_(True)
            with CommAccounting(activations=False) as acct:
                out = m(x, e, timestep, return_dict=False, **kwargs)[0]
                torch.nn.functional.mse_loss(out, target).backward()
            runs.append((out.detach(), x.grad, e.grad, acct))
        reduce_gradients(model.parameters())
        (out_ref, dx_ref, de_ref, _), (out, dx, de, acct) = runs
        dist.all_reduce(dx)
        dist.all_reduce(de)
        grads = {k: (p.grad, q.grad) for (k, p), q in zip(model.named_parameters(), reference.parameters())
                 if q.grad is not None}
        tag = ("rope" if rope else "sincos") + ("_ckpt" if ckpt else "")
        result |= {f"{tag}_out": (out - out_ref).abs().max().item(), f"{tag}_dvideo": (dx - dx_ref).abs().max().item(),
                   f"{tag}_dtext": (de - de_ref).abs().max().item(),
                   f"{tag}_grads": max((a - b).abs().max().item() for a, b in grads.values()),
                   f"{tag}_counts": (acct.count("all_to_all", "forward"), acct.count("all_gather", "forward"),
                                     acct.count(phase="backward"))}
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_cogvideox_builtin_plan_equals_one_process(n: int) -> None:
    pytest.importorskip("diffusers")
    for rank, d in enumerate(run_distributed(_cogvideox_worker, n)):
        print(f"CogVideoX n={n} rank {rank}: {d}")
        for tag in ("sincos", "rope", "rope_ckpt"):
            for key in ("out", "dvideo", "dtext", "grads"):
                assert d[f"{tag}_{key}"] < 1e-9, (rank, tag, key, d)
            # no all_gather for the text; under checkpointing the recompute replays the forward's switches
            # (dsp_plugin.plan.recompute) instead of issuing them again: 2 adjoints per layer either way
            assert d[f"{tag}_counts"] == (2 * LAYERS, 1, 2 * LAYERS), (tag, d)


def _primitive_worker(rank: int, n: int) -> dict[str, float]:
    """``to_heads(replicated=)`` / ``from_heads(replicated=)`` around GQA attention against one process.

    10 query heads reading 2 K/V heads on 4 ranks (head chunks 3, 3, 2, 2: rank 1's query heads 3, 4, 5 read
    K/V heads 0, 0, 1, so its K/V are repeated locally), 5 video tokens sharded (2, 1, 1, 1), 3 text tokens
    whole on every rank.
    """
    from dsp_plugin import from_heads, to_heads
    from dsp_plugin.comm import chunk_sizes
    from dsp_plugin.packing import offsets

    torch.set_default_dtype(torch.float64)
    F = torch.nn.functional
    g = torch.Generator().manual_seed(7)
    video = [torch.randn(2, 5, h, 4, generator=g) for h in (10, 2, 2)]     # q, k, v [B, S, heads, Dh]
    text = [torch.randn(2, 3, h, 4, generator=g) for h in (10, 2, 2)]
    weight = torch.randn(2, 8, 10, 4, generator=g)                         # a loss over every output token

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True).transpose(1, 2)

    full = [torch.cat([t, x], dim=1).requires_grad_(True) for t, x in zip(text, video)]
    (attend(*full) * weight).sum().backward()
    start, size = offsets(chunk_sizes(5, n))[rank], chunk_sizes(5, n)[rank]
    mine = [x.narrow(1, start, size).clone().requires_grad_(True) for x in video]
    whole = [t.clone().requires_grad_(True) for t in text]
    q, k, v, q_t, k_t, v_t = to_heads(*mine, seq_dim=1, head_dim=2, global_len=5, replicated=tuple(whole))
    out = attend(torch.cat([q_t, q], dim=1), torch.cat([k_t, k], dim=1), torch.cat([v_t, v], dim=1))
    out_v, out_t = from_heads(out[:, 3:], seq_dim=1, head_dim=2, global_len=5, heads=10, replicated=out[:, :3])
    ref = attend(*full).detach()
    # the text output is replicated: each rank's loss counts it 1/n, so the gradients sum to the one-process ones
    ((out_v * weight[:, 3:].narrow(1, start, size)).sum() + (out_t * weight[:, :3]).sum() / n).backward()
    text_grads = [t.grad.clone() for t in whole]
    for t in text_grads:
        dist.all_reduce(t)
    return {"out_video": (out_v - ref[:, 3:].narrow(1, start, size)).abs().max().item(),
            "out_text": (out_t - ref[:, :3]).abs().max().item(),
            "grad_video": max((x.grad - f.grad[:, 3:].narrow(1, start, size)).abs().max().item()
                              for x, f in zip(mine, full)),
            "grad_text": max((t - f.grad[:, :3]).abs().max().item() for t, f in zip(text_grads, full))}


def test_primitives_with_replicated_tokens_and_gqa() -> None:
    for rank, d in enumerate(run_distributed(_primitive_worker, 4)):
        print(f"primitives n=4 rank {rank}: {d}")
        assert max(d.values()) < 1e-12, (rank, d)
