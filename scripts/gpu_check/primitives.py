"""The primitives, the overlapped switch and the head switch on CUDA tensors: bit-exact against one process.

Two gloo processes share one GPU (``cuda:0``): what a one-GPU machine can run of a
2-rank group (NCCL refuses two ranks on one device). Every rank builds the same
global tensors from one seed; each result is compared with ``torch.equal`` to the
slice of the global tensor it must hold (``torch.tensor_split``'s chunks):

- ``split`` / ``dynamic_switch`` / ``gather`` on a [B, T, S, D] video, T and S uneven;
- ``switch_apply`` (the all-to-all of chunk i+1 in flight while fn runs on chunk i);
- ``to_heads`` / ``from_heads`` with 3 heads on 2 ranks, and with 1 head (rank 1 holds none);
- a shard that is empty (1 frame on 2 ranks), and the STDiT through ``parallelize`` with one (bf16, SDPA's
  default kernel), within bf16's tolerance of one process.

    python scripts/gpu_check/primitives.py            # cuda:0 when CUDA is present
    python scripts/gpu_check/primitives.py --device cpu   # the same checks on the CPU (the test suite runs it)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402


def _chunk(x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    return torch.tensor_split(x, n, dim=dim)[rank]


def worker(rank: int, n: int, device_name: str) -> tuple[int, list[str]]:
    from dsp_plugin import dynamic_switch, from_heads, gather, split, to_heads
    from dsp_plugin.comm import switch_apply
    from dsp_plugin.topology import Topology, set_topology

    device = torch.device(device_name)
    set_topology(Topology.world())
    g = torch.Generator().manual_seed(0)
    failures: list[str] = []
    checked = [0]

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        checked[0] += 1
        if got.device != device or not torch.equal(got.cpu(), want.cpu()):
            failures.append(f"rank {rank}: {name}: {tuple(got.shape)} on {got.device}, expected "
                            f"{tuple(want.shape)} on {device}")

    for frames in (5, 1):                       # 5: uneven (3 + 2); 1: rank 1's shard is empty
        x = torch.randn(2, frames, 7, 8, generator=g).to(device)
        t_shard = split(x, 1)
        same(f"split T={frames}", t_shard, _chunk(x, 1, n, rank))
        s_shard = dynamic_switch(t_shard, 1, 2)
        same(f"switch T={frames}", s_shard, _chunk(x, 2, n, rank))
        same(f"gather T={frames}", gather(s_shard, 2), x)
        doubled = switch_apply(t_shard, lambda piece: piece * 2, 1, 2, chunks=2)
        same(f"switch_apply T={frames}", doubled, _chunk(x * 2, 2, n, rank))
    for heads in (3, 1):                        # 1 head on 2 ranks: rank 1 attends over no head
        q, k, v = (torch.randn(2, 9, heads, 4, generator=g).to(device) for _ in range(3))
        shards = [_chunk(t, 1, n, rank) for t in (q, k, v)]
        full = to_heads(*shards, seq_dim=1, head_dim=2, global_len=9)
        for name, got, whole in zip("qkv", full, (q, k, v)):
            same(f"to_heads {name} H={heads}", got, _chunk(whole, 2, n, rank))
        back = from_heads(full[0], seq_dim=1, head_dim=2, global_len=9, heads=heads)
        same(f"from_heads H={heads}", back, shards[0])
    failures += empty_shard_plan(device, rank)
    checked[0] += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return checked[0], failures


def empty_shard_plan(device: torch.device, rank: int) -> list[str]:
    """The STDiT (axes H, W, T; a 1 x 1 patch grid) through ``parallelize`` in bf16 with SDPA's default kernel:
    its temporal blocks switch to H or W, so rank 1's shard is empty (on an H200 with torch 2.11 SDPA returned
    None for that batch of 0). Forward and backward within bf16's tolerance of one process on the same device."""
    import copy

    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.models.stdit import STDiT, STDiTConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = STDiT(STDiTConfig.preset("tiny", axes=3)).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 5, 2, 2, generator=g).to(device, dtype)
    timestep, text = torch.tensor([3, 500], device=device), torch.randn(2, 3, 16, generator=g).to(device, dtype)
    try:
        outs = []
        for model in (reference, dsp_plugin.parallelize(copy.deepcopy(reference))):
            out = model(latents, timestep, text)
            out.float().square().mean().backward()
            outs.append(out.float())
        reduce_gradients(model.parameters())
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        return [f"rank {rank}: empty shard through parallelize: {type(exc).__name__}: {exc}"]
    err = (outs[0] - outs[1]).abs().max().item()
    gerr = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    ok = err <= 3e-2 and gerr <= 3e-2
    return [] if ok else [f"rank {rank}: empty shard through parallelize: output off by {err:.1e}, grads {gerr:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default; SKIP without CUDA) or cpu")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        skip("no CUDA device")
    from dsp_plugin.spawn import spawn

    start = time.perf_counter()
    results = spawn(worker, 2, args.device, timeout=300)
    checked, failures = sum(r[0] for r in results), [f for r in results for f in r[1]]
    for failure in failures:
        print(failure)
    finish(not failures, f"{checked - len(failures)}/{checked} results right on {args.device} (primitives bit-exact, "
                         f"the empty-shard plan within bf16's 3e-2; 2 gloo ranks, "
                         f"{time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
