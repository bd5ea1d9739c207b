"""What each bench rank does: every method on the same model and input, measured the same way.

The model is the reference STDiT with adaLN and cross-attention to a text
embedding. Every method runs twice: plain, and with full-block activation
checkpointing (each block wrapped in ``torch.utils.checkpoint``, the switch or
the baseline's collectives inside it, as the paper's ``--grad_checkpoint`` did),
labelled ``<method>`` and ``<method>+ckpt``. Per label, on every rank:

1. one accounted step (forward + backward under ``CommAccounting``): the
   collectives issued between the first block's entry and the last block's exit
   (forward) and between the gradient reaching the last block's output and
   leaving the first block's input (backward, which includes the recomputed
   forward under checkpointing) are the per-layer traffic, divided by the number
   of layers; the model's entry split and exit gather are left out, as in paper
   Table 3. Saved-activation bytes come from the same step;
2. the output compared with the single-process model (a sanity column);
3. warm-up steps, with the peak RSS reset before and read after;
4. once every label is built, the timed rounds: each round runs one step
   (zero_grad + forward + backward; no optimizer, no gradient reduction, the
   same for every method) of every label, in rotating order, so load drift on a
   shared machine hits every method alike and each round gives one paired
   time ratio per method.

Then a micro-benchmark: one ``dynamic_switch`` of the bench's activation
against one bare ``all_to_all_single`` of the same bytes.
"""

from __future__ import annotations

import copy
import re
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsp_plugin.accounting import CommAccounting
from dsp_plugin.backend import current_device, synchronize
from dsp_plugin.bench.config import BenchConfig

_START = time.perf_counter()


def progress(rank: int, message: str) -> None:
    """One line on stderr from rank 0, with seconds since this rank started."""
    if rank == 0:
        print(f"[bench {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def _peak_rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
            f.write("5")
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(match.group(1)) * 1024 if match else 0
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(cfg: BenchConfig) -> nn.Module:
    from dsp_plugin.models import STDiT, STDiTConfig

    torch.manual_seed(0)
    # adaLN + cross-attention to text: the block the paper's harness trained (OpenSora's STDiT)
    model = STDiT(STDiTConfig(depth=cfg.depth, hidden_size=cfg.hidden, num_heads=cfg.heads, text_dim=cfg.text_dim))
    return model.to(current_device())     # this rank's GPU under NCCL (dsp_plugin.backend), else the CPU


class _Checkpointed(nn.Module):
    """One block under full activation checkpointing; the block's own hooks (DSP's switch) run inside."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Wrap every block of an already parallelized model (so its hooks and replaced modules are inside)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _Checkpointed(block)
    return model


def parallelize(method: str, model: nn.Module) -> nn.Module:
    if method == "dsp":
        from dsp_plugin import parallelize as dsp_parallelize

        return dsp_parallelize(model)
    from dsp_plugin.baselines import PARALLELIZE

    return PARALLELIZE[method](model)


class _LayerWindow:
    """Record indices that bracket the blocks in forward and in backward (see the module docstring)."""

    def __init__(self, model: nn.Module, acct: CommAccounting) -> None:
        self.acct, self.marks = acct, {}
        first, last = model.blocks[0], model.blocks[-1]

        def mark(name: str) -> Any:
            def hook(*_: Any) -> None:
                self.marks[name] = len(acct.records)
            return hook

        def first_pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            mark("fwd_start")()
            if args[0].requires_grad:
                args[0].register_hook(mark("bwd_end"))

        def last_post(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            mark("fwd_end")()
            out.register_hook(mark("bwd_start"))

        self.handles = [first.register_forward_pre_hook(first_pre, prepend=True),
                        last.register_forward_hook(last_post)]

    def bytes_sent(self, phase: str) -> int:
        lo, hi = self.marks[f"{phase}_start"], self.marks[f"{phase}_end"]
        return sum(r.bytes_sent for r in self.acct.records[lo:hi])

    def ops(self, phase: str) -> dict[str, int]:
        lo, hi = self.marks[f"{phase}_start"], self.marks[f"{phase}_end"]
        out: dict[str, int] = {}
        for r in self.acct.records[lo:hi]:
            out[r.op] = out.get(r.op, 0) + 1
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(cfg: BenchConfig) -> Inputs:
    """Latents, timesteps, text embedding and the loss weight (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(cfg.batch, 4, cfg.frames, cfg.height, cfg.width, generator=g)
    text = torch.randn(cfg.batch, cfg.text_len, cfg.text_dim, generator=g)
    weight = torch.randn(latents.shape, generator=g)
    timestep = torch.arange(cfg.batch, dtype=torch.float32) * 7.0
    device = current_device()
    return latents.to(device), timestep.to(device), text.to(device), weight.to(device)


def _train_step(model: nn.Module, inputs: Inputs) -> None:
    latents, timestep, text, weight = inputs
    model.zero_grad(set_to_none=True)
    (model(latents, timestep, text) * weight).sum().backward()


def label(method: str, ckpt: bool) -> str:
    return f"{method}+ckpt" if ckpt else method


def measure_method(method: str, ckpt: bool, cfg: BenchConfig, rank: int) -> tuple[nn.Module, dict[str, Any]]:
    """Phase 1 for one label: traffic, saved activations, error, peak RSS. Returns the model for phase 2."""
    reference = build_model(cfg)
    model = parallelize(method, copy.deepcopy(reference))
    if ckpt:
        checkpoint_blocks(model)
    inputs = _inputs(cfg)
    latents, timestep, text, weight = inputs

    progress(rank, f"{label(method, ckpt)}: accounted step, {cfg.warmup} warm-up steps")
    with CommAccounting() as acct:
        window = _LayerWindow(model, acct)
        x = latents.clone().requires_grad_()
        out = model(x, timestep, text)
        (out * weight).sum().backward()
    window.remove()
    with torch.no_grad():
        max_err = (out.detach() - reference(latents, timestep, text)).abs().max().item()
    del out, x, reference
    _peak_rss_reset()
    for _ in range(cfg.warmup):
        _train_step(model, inputs)
    return model, {"method": method, "checkpointing": ckpt,
        "fwd_bytes_per_layer": window.bytes_sent("fwd") / cfg.depth,
        "bwd_bytes_per_layer": window.bytes_sent("bwd") / cfg.depth,
        "fwd_ops": window.ops("fwd"),
        "bwd_ops": window.ops("bwd"),
        "saved_activation_bytes": acct.saved_activation_bytes,
        "peak_rss_bytes": _peak_rss_bytes(),
        "max_abs_err_vs_single": max_err,
    }


def time_methods(models: dict[str, nn.Module], cfg: BenchConfig,
                 rank: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Phase 2: timed rounds, each running every label once in rotating order, so load drift on a
    shared machine hits every method alike instead of whichever ran last.

    Returns wall seconds and this process's CPU seconds (user + system, so gloo's socket copies
    count) per step: on a shared machine the CPU time leaves out the time other jobs held the
    core, which the wall time cannot.
    """
    inputs = _inputs(cfg)
    names = list(models)
    times: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    for step in range(cfg.steps):
        if step % 3 == 0:
            progress(rank, f"timed rounds {step + 1}-{min(step + 3, cfg.steps)} of {cfg.steps}, "
                           f"each over {len(names)} labels")
        for name in names[step % len(names):] + names[:step % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            _train_step(models[name], inputs)
            synchronize(inputs[0].device)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return times, cpu


def micro_benchmark(cfg: BenchConfig, rank: int, n: int) -> dict[str, Any]:
    """Median seconds of one S(T) -> S(S) switch and one bare all_to_all_single of the same bytes."""
    from dsp_plugin.baselines.comm import bare_all_to_all
    from dsp_plugin.comm import chunk_sizes, dynamic_switch

    progress(rank, f"micro-benchmark: switch vs bare all_to_all_single, {cfg.micro_reps} reps")
    frames = chunk_sizes(cfg.frames, n)[rank]
    x = torch.randn(cfg.batch, frames, cfg.spatial, cfg.hidden, device=current_device())   # [B, T/N, S, D]
    flat = x.reshape(-1).clone()
    group = dist.group.WORLD
    results: dict[str, list[float]] = {"switch": [], "all_to_all_single": []}
    for _ in range(3):  # warm-up
        dynamic_switch(x, 1, 2, global_len=cfg.frames)
        bare_all_to_all(flat, group=group)
    for _ in range(cfg.micro_reps):
        synchronize(x.device)
        start = time.perf_counter()
        dynamic_switch(x, 1, 2, global_len=cfg.frames)
        synchronize(x.device)
        results["switch"].append(time.perf_counter() - start)
        start = time.perf_counter()
        bare_all_to_all(flat, group=group)
        synchronize(x.device)
        results["all_to_all_single"].append(time.perf_counter() - start)
    return {"bytes_per_rank": x.numel() * x.element_size(),
            **{k: statistics.median(v) for k, v in results.items()}}


def worker(rank: int, world_size: int, cfg: BenchConfig, methods: tuple[str, ...]) -> dict[str, Any]:
    """Entry point of one bench rank; returns this rank's raw numbers."""
    from dsp_plugin.log import quiet_third_party

    quiet_third_party()                 # third-party notices stay out of the tables
    from dsp_plugin.topology import Topology, set_topology

    set_topology(Topology.world())   # the whole world is the DSP group (group=None refuses without one)
    out: dict[str, Any] = {"methods": {}}
    models: dict[str, nn.Module] = {}
    runs = [(m, c) for c in cfg.checkpointing for m in methods]
    for i, (method, ckpt) in enumerate(runs):
        name = label(method, ckpt)
        progress(rank, f"[{i + 1}/{len(runs)}] {name}")
        try:
            models[name], out["methods"][name] = measure_method(method, ckpt, cfg, rank)
        except (ValueError, ImportError) as exc:  # head limit, DeepSpeed missing: reported, not fatal
            out["methods"][name] = {"error": str(exc), "method": method, "checkpointing": ckpt}
    wall, cpu = time_methods(models, cfg, rank)
    for name in wall:
        out["methods"][name]["step_times_s"] = wall[name]
        out["methods"][name]["cpu_times_s"] = cpu[name]
    out["micro"] = micro_benchmark(cfg, rank, world_size)
    return out
