"""The head switch's SDPA level is left off for a ``Heads`` module seen attending through diffusers' dispatch alone.

The SDPA level is a ``TorchFunctionMode``: while it is entered every torch op of the module is a Python call
(~40 per Wan attention, most of the plan runtime's cost at the bench's size). A module whose call attended through
diffusers' dispatch and never through SDPA runs its next calls without it, while its attention processor is the
same object. Oracle: the same module unparallelized on one process (fp64). Cases, on 2 gloo ranks:

- dispatch alone: the first call enters the mode (it sees the module's ops), later calls do not (0 ops), every
  output and the gradients equal one process;
- the processor replaced (``module.processor = ...``, as ``set_attn_processor`` does) by one that calls SDPA itself:
  watched again, the output equals one process;
- the same processor object turning to SDPA (a flag): refused on every rank, naming the module and why; the
  next call is watched again and equals one process;
- under ``DSP_CHECK=1`` (``checks.set_check_mode("always")``) every call is watched.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402


class _Processor:
    """q, k, v ``[B, L, H, Dh]`` through diffusers' ``dispatch_attention_fn``, or (``direct``) through SDPA."""

    def __init__(self, direct: bool = False) -> None:
        self.direct = direct

    def __call__(self, attn: _Attention, x: torch.Tensor) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in attn.qkv(x).chunk(3, dim=-1))
        if self.direct:
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        else:
            out = dispatch_attention_fn(q, k, v)
        return attn.proj(out.flatten(2))


class _Attention(nn.Module):
    def __init__(self, dim: int = 12, heads: int = 3) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.processor = _Processor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.processor(self, x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _plan() -> dict[str, object]:
    from dsp_plugin.plan import Block, Gather, Heads, Split

    return {"": Split("x", "B L D", shard="L"), "attn": [Block("B L D", arg="x"), Heads(), Gather("out", "B L D")]}


def _worker(rank: int, n: int) -> dict[str, object]:
    import dsp_plugin
    from dsp_plugin import checks
    from dsp_plugin.plan import attention

    torch.manual_seed(0)
    reference = _Model().double()
    model = dsp_plugin.parallelize(copy.deepcopy(reference), _plan())
    seen = [0]
    original = attention._HeadSwitchMode.__torch_function__

    def counted(*args: object, **kwargs: object) -> object:  # an op through the SDPA level
        seen[0] += 1
        return original(*args, **kwargs)

    attention._HeadSwitchMode.__torch_function__ = counted  # type: ignore[method-assign]
    x = torch.randn(2, 7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result: dict[str, object] = {}

    def call(label: str) -> None:
        seen[0] = 0
        expected = reference(x)
        try:
            out = model(x)
        except RuntimeError as exc:
            result[label] = f"RuntimeError: {exc}"
            return
        result[label] = ((out - expected).abs().max().item(), seen[0])

    for i in range(3):  # dispatch alone: watched once
        call(f"dispatch {i}")
    xg = x.clone().requires_grad_(True)  # and with a backward (the gradients of the parameters and the input)
    model(xg).square().sum().backward()
    dsp_plugin.reduce_gradients(model.parameters())
    xr = x.clone().requires_grad_(True)
    reference(xr).square().sum().backward()
    grads = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())]
    result["grads"] = max(grads)
    dist.all_reduce(xg.grad)  # each rank's input gradient is its partial sum (the project's convention)
    result["dx"] = (xg.grad - xr.grad).abs().max().item()
    for m in (model, reference):  # a new processor that calls SDPA itself: watched again
        m.attn.processor = _Processor(direct=True)
    for i in range(2):
        call(f"replaced {i}")
    for m in (model, reference):  # back to dispatch, learnt; then the same object turns to SDPA
        m.attn.processor = _Processor()
    call("learn again")
    call("learnt")
    for m in (model, reference):
        m.attn.processor.direct = True
    call("same object, now SDPA")
    call("after the refusal")
    for m in (model, reference):  # DSP_CHECK=1: watched at every call, learnt or not
        m.attn.processor = _Processor()
    checks.set_check_mode("always")
    try:
        for i in range(2):
            call(f"checked {i}")
    finally:
        checks.set_check_mode(None)
    dist.barrier()
    return result


@pytest.mark.parametrize("n", [2])
def test_sdpa_level_is_left_off_where_dispatch_serves(n: int) -> None:
    results = run_distributed(_worker, n)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for i in range(3):
            diff, ops = r[f"dispatch {i}"]
            assert diff < 1e-12, (rank, i, diff)
            assert (ops > 0) == (i == 0), (rank, i, ops)  # the first call watched, the next ones not
        assert r["grads"] < 1e-12 and r["dx"] < 1e-12, (r["grads"], r["dx"])
        for label in ("replaced 0", "replaced 1", "after the refusal"):
            diff, ops = r[label]
            assert diff < 1e-12 and ops > 0, (rank, label, diff, ops)  # SDPA called directly: always watched
        assert r["learn again"][1] > 0 and r["learnt"][1] == 0, (rank, r["learn again"], r["learnt"])
        assert r["checked 0"][1] > 0 and r["checked 1"][1] > 0, (rank, r["checked 0"], r["checked 1"])
        message = r["same object, now SDPA"]
        assert isinstance(message, str) and message.startswith(
            "RuntimeError: attn: this Heads module finished without an attention call the head switch intercepted "
            "(no diffusers attention backend ran inside it, as one did in its earlier calls: the SDPA level was not "
            "watched in this call"), message
