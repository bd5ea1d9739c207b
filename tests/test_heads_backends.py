"""The head switch under every attention kernel a model may call (issue 25 item 1).

Oracle: the unmodified diffusers model on one process with the same backend, same weights and batch (fp64 where
the backend runs it on CPU). diffusers 0.42.1's backends that run on CPU: ``native``, ``_native_math``,
``_native_flash`` (forward and backward) and ``flex`` (forward only: "FlexAttention does not support backward on
CPU"); the others need CUDA or a package (flash-attn, sageattention, xformers, kernels). Beside them a backend
this test registers in diffusers' own registry that calls no SDPA (a plain ``softmax(q k^T) v``), which stands for
any kernel the head switch has never seen: on main it attended each rank's frames only. Tiny Wan and CogVideoX
(the plan tests' configs) at N=2 and 4: uneven frames, and on 4 ranks one rank holds no head. A ``Heads`` module
whose attention goes through neither level raises on every rank; diffusers' own context parallelism on a ``Heads``
module is refused at ``parallelize``.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("diffusers")

from dsp_plugin.accounting import CommAccounting  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LAYERS = 2
# (backend, dtype, with backward); flex runs forward only on CPU. CogVideoX's processor calls SDPA itself whatever
# the backend (set_attention_backend leaves it alone): two rows show the setting changes nothing there
BACKENDS = {"wan": (("native", torch.float64, True), ("_native_math", torch.float64, True),
                    ("_native_flash", torch.float64, True), ("plain", torch.float64, True),
                    ("flex", torch.float64, False), ("flex", torch.float32, False)),
            "cogvideox": (("plain", torch.float64, True), ("flex", torch.float32, False))}
TOLERANCE = {torch.float64: 5e-9, torch.float32: 2e-5}
PLAIN_SLOT = "_native_efficient"  # a name diffusers' set_attention_backend accepts on CPU; no CPU kernel of its own


def plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, scale: float | None = None,
                    _parallel_config: object = None) -> torch.Tensor:
    """A backend that calls no SDPA: ``softmax(q k^T * scale + mask) v`` on diffusers' ``[B, L, H, Dh]``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


def register_plain() -> None:
    """Put ``plain_attention`` in diffusers' registry (this process only: each worker is its own process)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.register(AttentionBackendName(PLAIN_SLOT))(plain_attention)


def _wan(dtype: torch.dtype) -> nn.Module:
    from dsp_plugin.testing.tiny import tiny_wan

    return tiny_wan(layers=LAYERS, heads=3, head_dim=8).to(dtype)


def _cogvideox(dtype: torch.dtype) -> nn.Module:
    from tests.test_plan_joint import _tiny_cogvideox

    return _tiny_cogvideox(rope=False).to(dtype)


def _inputs(name: str, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    if name == "wan":
        latents, text = torch.randn(2, 4, 5, 6, 6, generator=g), torch.randn(2, 7, 16, generator=g)
        return (latents.to(dtype), torch.tensor([3, 700]), text.to(dtype)), \
            torch.randn(2, 4, 5, 6, 6, generator=g).to(dtype)
    latents, text = torch.randn(2, 5, 4, 6, 6, generator=g), torch.randn(2, 7, 16, generator=g)
    return (latents.to(dtype), text.to(dtype), torch.tensor([3, 700])), \
        torch.randn(2, 5, 4, 6, 6, generator=g).to(dtype)


def _step(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
          grad: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], CommAccounting | None]:
    # flex_attention compiles itself even in eager mode, which refuses CommAccounting's dispatch mode (torch 2.13:
    # "non-infra torch dispatch mode present"): its collectives go uncounted
    acct = CommAccounting(activations=False) if grad else None
    with torch.set_grad_enabled(grad), acct or contextlib.nullcontext():
        out = model(*inputs, return_dict=False)[0]
        if grad:
            torch.nn.functional.mse_loss(out, target).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, acct


def _backends_worker(rank: int, n: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin import reduce_gradients

    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "Attention backends are an experimental feature"
    register_plain()
    result: dict[str, object] = {}
    for name, build in (("wan", _wan), ("cogvideox", _cogvideox)):
        for backend, dtype, grad in BACKENDS[name]:
            slot = PLAIN_SLOT if backend == "plain" else backend
            reference = build(dtype)
            model = copy.deepcopy(reference)
            for m in (reference, model):
                m.set_attention_backend(slot)
            dsp_plugin.parallelize(model)
            inputs, target = _inputs(name, dtype)
            out_ref, g_ref, _ = _step(reference, inputs, target, grad)
            out, grads, acct = _step(model, inputs, target, grad)
            key = f"{name}/{backend}/{str(dtype).removeprefix('torch.')}"
            result[f"{key}/out"] = (out - out_ref).abs().max().item()
            if grad:
                reduce_gradients(model.parameters())
                grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
                assert grads.keys() == g_ref.keys(), sorted(set(grads) ^ set(g_ref))
                result[f"{key}/grads"] = max((grads[k] - g_ref[k]).abs().max().item() for k in grads)
            if acct is not None:
                result[f"{key}/all_to_all"] = acct.count("all_to_all", "forward")
    dist.barrier()
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_every_backend_equals_one_process(n: int) -> None:
    for rank, d in enumerate(run_distributed(_backends_worker, n)):
        print(f"n={n} rank {rank}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in d.items()))
        for key, value in d.items():
            if key.endswith("/all_to_all"):  # one switch there and one back per attention: never two levels
                assert value == 2 * LAYERS, (rank, key, value)
            else:
                dtype = torch.float32 if "/float32/" in key else torch.float64
                assert value < TOLERANCE[dtype], (rank, key, value)


class _ManualAttention(nn.Module):
    """Attention through a kernel neither level sees: the matmuls written out in the module."""

    def __init__(self, dim: int = 12, heads: int = 3) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).transpose(1, 2).flatten(2)


class _ManualModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _ManualAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _unseen_worker(rank: int, n: int) -> str:
    import dsp_plugin
    from dsp_plugin.plan import Block, Gather, Heads, Split

    torch.manual_seed(0)
    model = dsp_plugin.parallelize(_ManualModel(), {"": Split("x", "B L D", shard="L"),
                                                    "attn": [Block("B L D", arg="x"), Heads(), Gather("out", "B L D")]})
    try:
        model(torch.randn(2, 5, 12))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()
    return "no error"


@pytest.mark.parametrize("n", [2])
def test_unseen_kernel_raises_on_every_rank(n: int) -> None:
    for rank, message in enumerate(run_distributed(_unseen_worker, n)):
        print(f"rank {rank}: {message}")
        assert message.startswith("RuntimeError: attn: this Heads module finished without an attention call"), \
            message
        assert f"saw only this rank's {3 if rank == 0 else 2} tokens" in message, message


def test_diffusers_context_parallelism_is_refused_at_parallelize() -> None:
    from diffusers import ContextParallelConfig, ParallelConfig

    import dsp_plugin

    model = _wan(torch.float64)
    model.blocks[1].attn1.processor._parallel_config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ulysses_degree=2))
    with pytest.raises(ValueError, match=r"blocks\.1\.attn1 \(WanAttnProcessor\) has diffusers' context "
                                         r"parallelism enabled"):
        dsp_plugin.parallelize(model, group=None)
