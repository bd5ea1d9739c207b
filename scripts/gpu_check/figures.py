"""The GPU figures: a DSP layer's TFLOP/s and MFU, FP8 over bf16, the switches' copy rates, Wan's forward.

Everything is timed with CUDA events after warm-up, beside two ceilings measured in
the same process: a device-to-device copy and an 8192^3 bf16 matrix product.

- **DSP layer**: one STDiT layer (a spatial and a temporal ``AxialBlock``, hidden
  1152, 16 heads) on one rank's share of a DSP=8 video of 32 x 64 x 64 tokens:
  the spatial block on ``[2, 4, 4096, 1152]`` (T sharded), the temporal block on
  ``[2, 32, 512, 1152]`` (S sharded), 32,768 tokens per rank, forward and backward
  in bf16. FLOPs are counted by ``torch.utils.flop_counter`` (matrix products and
  attention); MFU is against the datasheet's dense bf16 peak and the matmul ceiling.
- **FP8**: the same layer with every ``nn.Linear`` whose rows divide by 16 run by
  ``torch._scaled_mm`` (per-tensor scales, e4m3 forward, e5m2 gradients: the
  "hybrid" recipe), beside bf16; and the FP8 matrix-product ceiling.
- **Copies**: the switch's pack and unpack (``packing.split_blocks`` /
  ``join_blocks``, what ``dynamic_switch`` runs around its all-to-all) and the head
  switch's (``head_switch.exchange._seq_to_heads`` with the all-to-all replaced by
  the identity, which one GPU makes exact for equal shares), in GB/s of tensor bytes.
- **Wan**: diffusers' ``WanTransformer3DModel`` at Wan 2.1 1.3B's configuration
  (random weights, bf16), one forward at 480x832, 81 frames (latents 21 x 60 x 104,
  32,760 tokens), with a 512-token prompt.

Writes ``bench_calibration.json`` (``layer_tflops``, ``pack_unpack_gbps``: the
scale model's MEASURED rates, ``python -m dsp_plugin.bench --calibration``) to
``$GPU_CHECK_LOGS`` (default ``out/gpu_check``).

    python scripts/gpu_check/figures.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}   # dense bf16 TFLOP/s, NVIDIA's datasheets (SXM)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def timed(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Seconds per call: the mean of ``iters`` calls between CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def ceilings() -> dict[str, float]:
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")          # 1 GiB
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_s = timed(lambda: a @ b)
    out = {"copy_gbps": x.numel() / copy_s / 1e9, "matmul_bf16_tflops": 2 * 8192 ** 3 / mm_s / 1e12}
    try:
        a8, b8 = a.to(E4M3), b.t().contiguous().to(E4M3).t()
        one = torch.ones((), device="cuda")
        mm8_s = timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        out["matmul_fp8_tflops"] = 2 * 8192 ** 3 / mm8_s / 1e12
    except Exception as exc:  # noqa: BLE001 - reported, the bf16 figures stand alone
        print(f"FP8 matmul ceiling not measured: {type(exc).__name__}: {exc}")
    return out


# --------------------------------------------------------------------------- FP8 linear (hybrid recipe)

def _quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.detach().abs().amax().float() / torch.finfo(dtype).max).clamp(min=1e-12)
    return (t / scale).to(dtype), scale


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _quantize(x2, E4M3)
        wq, ws = _quantize(weight, E4M3)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.shape = x.shape
        y = torch._scaled_mm(xq, wq.t(), xs, ws, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        xq, xs, wq, ws = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, gs = _quantize(g2, E5M2)
        gx = torch._scaled_mm(gq, wq.t().contiguous().t(), gs, ws, out_dtype=grad.dtype)
        gw = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), gs, xs, out_dtype=grad.dtype)
        return gx.view(ctx.shape), gw


class Fp8Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows % 16 or self.in_features % 16 or self.out_features % 16:
            return F.linear(x, self.weight, self.bias)      # _scaled_mm wants multiples of 16
        y = _Fp8Matmul.apply(x, self.weight)
        return y if self.bias is None else y + self.bias


def to_fp8(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            child.__class__ = Fp8Linear
        else:
            to_fp8(child)
    return module


# --------------------------------------------------------------------------- the DSP layer

def dsp_layer(fp8: bool) -> tuple[float, float]:
    """(seconds, FLOPs) of one forward+backward of a rank's share of one STDiT layer at DSP=8."""
    from torch.utils.flop_counter import FlopCounterMode

    from dsp_plugin.models.stdit import AxialBlock, STDiTConfig

    cfg = STDiTConfig(depth=1, hidden_size=1152, num_heads=16, text_dim=None)
    spatial = AxialBlock(cfg, 2, add_pos_embed=True).to("cuda", torch.bfloat16)
    temporal = AxialBlock(cfg, 1, add_pos_embed=True).to("cuda", torch.bfloat16)
    if fp8:
        to_fp8(spatial), to_fp8(temporal)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = torch.randn(2, 4, 4096, 1152, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    xt = torch.randn(2, 32, 512, 1152, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    c = torch.randn(2, 1152, device="cuda", dtype=torch.bfloat16, generator=g)

    def step() -> None:
        (spatial(xs, c).float().mean() + temporal(xt, c).float().mean()).backward()

    with FlopCounterMode(display=False) as counter:
        step()
    return timed(step, warmup=2, iters=5), float(counter.get_total_flops())


# --------------------------------------------------------------------------- the switches' copies

def switch_copies(n: int = 8) -> tuple[float, float]:
    """GB/s of tensor bytes: the switch's pack + unpack, and the head switch's, on a rank's 32,768 tokens."""
    from dsp_plugin.comm import collectives
    from dsp_plugin.head_switch import exchange
    from dsp_plugin.packing import chunk_sizes, join_blocks, split_blocks

    x = torch.randn(2, 4, 4096, 1152, device="cuda", dtype=torch.bfloat16)     # [B, T/N, S, D], T -> S
    block = [2, 4, 4096 // n, 1152]

    def switch() -> torch.Tensor:
        send, _ = split_blocks(x, 2, n)                       # pack: chunks of S, one per peer
        return join_blocks(send, block, 1, chunk_sizes(4 * n, n))  # unpack: peers' frames joined along T

    switch_s = timed(switch)
    heads = 16
    q, k, v = (torch.randn(2, 16384, heads, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ex = exchange._Exchange(seq_dim=1, head_dim=2, seq_sizes=(16384,) * n,
                            ranges=(tuple(exchange.head_ranges(heads, n)),) * 3, heads=(heads,) * 3,
                            group=None, n=n, rank=0)
    real = collectives._all_to_all_flat
    collectives._all_to_all_flat = lambda send, send_splits, recv_splits, group: send   # one GPU: loopback
    try:
        heads_s = timed(lambda: exchange._seq_to_heads((q, k, v), ex))
    finally:
        collectives._all_to_all_flat = real
    # each copies its tensors' bytes twice (pack, unpack)
    return 2 * x.numel() * 2 / switch_s / 1e9, 2 * 3 * q.numel() * 2 / heads_s / 1e9


# --------------------------------------------------------------------------- Wan

def wan_forward() -> tuple[float, int]:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                  in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                  num_layers=30, cross_attn_norm=True, eps=1e-6)
    model = model.to("cuda", torch.bfloat16).eval()
    latents = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    with torch.no_grad():
        seconds = timed(lambda: model(latents, t, text, return_dict=False), warmup=1, iters=3)
    return seconds, 21 * 30 * 52


def main() -> None:
    if not torch.cuda.is_available():
        skip("no CUDA device")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 989.4e12)
    print(f"device: {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s of tensor bytes; bf16 matmul 8192^3 "
          f"{ceil['matmul_bf16_tflops']:.0f} TFLOP/s; FP8 matmul {ceil.get('matmul_fp8_tflops', float('nan')):.0f}")
    bf16_s, flops = dsp_layer(fp8=False)
    tflops = flops / bf16_s / 1e12
    print(f"DSP layer bf16 (a rank's 32,768 tokens at DSP=8, fwd+bwd): {bf16_s * 1e3:.2f} ms, {flops / 1e12:.3f} "
          f"TFLOP, {tflops:.0f} TFLOP/s, MFU {tflops * 1e12 / peak:.1%} of the {peak / 1e12:.1f} datasheet peak, "
          f"{tflops / ceil['matmul_bf16_tflops']:.1%} of the measured matmul ceiling")
    figures = {"device": name, "torch": torch.__version__, **ceil, "layer_bf16_ms": bf16_s * 1e3,
               "layer_tflop": flops / 1e12, "layer_tflops": tflops, "mfu": tflops * 1e12 / peak}
    try:
        fp8_s, _ = dsp_layer(fp8=True)
        figures["layer_fp8_ms"] = fp8_s * 1e3
        print(f"DSP layer FP8 (torch._scaled_mm linears): {fp8_s * 1e3:.2f} ms, {bf16_s / fp8_s:.2f}x bf16's speed")
    except Exception as exc:  # noqa: BLE001
        print(f"DSP layer FP8 not measured: {type(exc).__name__}: {exc}")
    switch_gbps, heads_gbps = switch_copies()
    figures.update(switch_pack_unpack_gbps=switch_gbps, head_switch_pack_unpack_gbps=heads_gbps)
    print(f"copies (tensor bytes): switch pack+unpack {switch_gbps:.0f} GB/s "
          f"({switch_gbps / ceil['copy_gbps']:.0%} of the device copy), head switch {heads_gbps:.0f} GB/s "
          f"({heads_gbps / ceil['copy_gbps']:.0%})")
    try:
        wan_s, tokens = wan_forward()
        figures.update(wan_forward_s=wan_s, wan_tokens=tokens)
        print(f"Wan 2.1 1.3B transformer forward, 480x832x81 ({tokens} tokens), bf16: {wan_s:.3f} s")
    except Exception as exc:  # noqa: BLE001
        print(f"Wan forward not measured: {type(exc).__name__}: {exc}")
    logs = os.environ.get("GPU_CHECK_LOGS", os.path.join(ROOT, "out/gpu_check"))
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, "figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    with open(os.path.join(logs, "bench_calibration.json"), "w") as f:
        json.dump({"layer_tflops": round(tflops, 1), "pack_unpack_gbps": round(switch_gbps, 1),
                   "source": f"{name}, scripts/gpu_check/figures.py, {time.strftime('%Y-%m-%d')}"}, f, indent=1)
    finish(True, f"{name}: DSP layer {tflops:.0f} TFLOP/s bf16 (MFU {tflops * 1e12 / peak:.0%}); switch copies "
                 f"{switch_gbps:.0f} GB/s vs device copy {ceil['copy_gbps']:.0f}")


if __name__ == "__main__":
    main()
