"""Train diffusers' Wan transformer with PyTorch FSDP2 and DSP: a complete script to copy and adapt.

    torchrun --standalone --nproc-per-node 4 examples/train_wan_fsdp2.py --dsp 2 --steps 20
    torchrun --standalone --nproc-per-node 4 examples/train_wan_fsdp2.py --dsp 2 --steps 10 \\
        --save-dir ckpt --save-every 5
    torchrun --standalone --nproc-per-node 4 examples/train_wan_fsdp2.py --dsp 2 --steps 20 \\
        --load-dir ckpt                                              # resumes at step 11
    torchrun --standalone --nproc-per-node 4 examples/train_wan_fsdp2.py --dsp 2 --steps 20 \\
        --load-dir ckpt/step5 --dp-replicate 2                       # step 6 on, as HSDP (DCP reshards)

The FSDP2 counterpart of ``train_wan_deepspeed.py``. What makes it DSP (marked ``# DSP``): one ``DeviceMesh`` with
a ``dsp`` dim, the topology read off it (``Topology.from_mesh``: ``group=None``, the loader's DP coordinate),
``dsp_plugin.parallelize(model, group=mesh["dsp"])`` (the built-in Wan plan: latents split on frames, the head
switch around self-attention, the output gathered), then ``dsp_plugin.fsdp.fully_shard`` (torch's ``fully_shard``
per block and on the root over ``dp_shard x dsp``, with the divide factor that gives the one-process gradient:
no loss scaling), and ``dsp_dataloader`` (every rank of a DSP group gets the same samples). The plan comes first,
then FSDP, as torchtitan applies context parallelism before FSDP (docs/fsdp.md).

Everything else is a plain FSDP2 loop: flow matching (rectified flow, as Wan is trained: ``x_t = (1 - s) x0 + s
noise``, the model predicts ``noise - x0`` at timestep ``1000 s``), bf16 parameters with fp32 gradient reduction
(``MixedPrecisionPolicy``), the model's own activation checkpointing (``enable_gradient_checkpointing``),
``torch.compile`` of each block's layers (``--compile``), AdamW with gradient clipping, and
``torch.distributed.checkpoint`` saves (``dsp_plugin.fsdp_checkpoint``: each rank writes its shards; ``latest``
is written last) holding the loader's position, so a resumed run continues with the same batches. Rank 0 logs
the mesh, the DSP groups and the first step's traffic, then the loss, step time and samples/s of every step.

The data stands in for what you would precompute once with the pipeline's VAE and text encoder: ``WanLatents``
draws latents, text embeddings, noise and the flow time of each sample from its index, so every rank (and a
resumed run) sees the same values. Replace it with your own ``Dataset`` of ``(latents [C, F, H, W], text [L, D],
noise [C, F, H, W], sigma [])``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import dsp_plugin
from dsp_plugin import backend, fsdp, fsdp_checkpoint
from dsp_plugin.comm import all_reduce_mean
from dsp_plugin.data import dsp_dataloader
from dsp_plugin.log import get_logger, setup
from dsp_plugin.steplog import describe_topology, log_first_call

log = get_logger("dsp_plugin.examples.train_wan_fsdp2")


class WanLatents(torch.utils.data.Dataset):
    """``samples`` training examples, each drawn from its index alone (the same on every rank and resume)."""

    def __init__(self, samples: int, latent: tuple[int, int, int, int], text: tuple[int, int], seed: int) -> None:
        self.samples, self.latent, self.text, self.seed = samples, latent, text, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return (torch.randn(self.latent, generator=g), torch.randn(self.text, generator=g),
                torch.randn(self.latent, generator=g), torch.rand((), generator=g))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random weights) or a WanTransformer3DModel directory")
    p.add_argument("--dsp", type=int, default=2, help="DSP size: ranks sharing one video (default 2)")
    p.add_argument("--dp-replicate", type=int, default=1,
                   help="HSDP: replicas of the FSDP shards (default 1: FSDP over every dp_shard x dsp rank)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"),
                   help="bf16: bf16 parameters in forward and backward, fp32 reduction and master weights "
                        "(default bf16)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="the model's own activation checkpointing, per block (default on)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block's layers (attention, cross-attention, feed-forward)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default inductor)")
    p.add_argument("--steps", type=int, default=10, help="the last optimizer step (default 10)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per data-parallel rank (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--samples", type=int, default=64, help="dataset size (default 64)")
    p.add_argument("--frames", type=int, default=5, help="latent frames (default 5)")
    p.add_argument("--size", type=int, default=8, help="latent height and width (default 8)")
    p.add_argument("--text-len", type=int, default=7, help="text tokens (default 7)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (torch.distributed.checkpoint)")
    p.add_argument("--save-every", type=int, default=None, help="save after every N steps (and after the last)")
    p.add_argument("--load-dir", default=None,
                   help="resume from this directory's latest checkpoint, or from this checkpoint (DIR/step<N>)")
    p.add_argument("--losses-json", default=None, help="rank 0 writes {step: loss} here")
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective waits for a peer")
    args = p.parse_args(argv)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("dsp", "dp_replicate", "steps", "micro_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    if world % (args.dsp * args.dp_replicate):
        p.error(f"--dsp {args.dsp} x --dp-replicate {args.dp_replicate} does not divide the world size {world}; "
                f"expected a divisor of {world}")
    if args.frames < args.dsp:
        p.error(f"--frames {args.frames} leaves a rank of --dsp {args.dsp} without a frame; expected >= {args.dsp}")
    if args.save_every is not None and not args.save_dir:
        p.error("--save-every needs --save-dir")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    if args.model != "tiny":
        return WanTransformer3DModel.from_pretrained(args.model, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)              # the same initial weights on every rank
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, rope_max_seq_len=32)


def flow_matching_loss(model: Any, batch: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Rectified flow: the model at ``x_t = (1 - s) x0 + s noise`` predicts the velocity ``noise - x0``. FSDP's
    mixed precision casts the inputs to the parameters' dtype."""
    x0, text, noise, sigma = (t.to(device) for t in batch)
    s = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    prediction = model(x_t, timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False)[0]
    return torch.nn.functional.mse_loss(prediction.float(), (noise - x0).float())


def main(argv: list[str] | None = None) -> dict[int, float]:
    """Parse ``argv``, join or start the process group, train; returns rank 0's ``{step: loss}``. Called in a
    process group that exists already (a notebook, a test), it trains there and leaves it open."""
    setup()
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.save_dir:
        fsdp_checkpoint.check_save_dir(args.save_dir)      # before any collective, on every rank
    if args.load_dir:
        fsdp_checkpoint.check_load_dir(args.load_dir)
    owned = not dist.is_initialized()
    device = backend.init_distributed(timeout_s=args.timeout).device if owned else backend.current_device()
    try:
        return train(args, device)
    finally:
        dsp_plugin.set_topology(None)
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> dict[int, float]:
    world = dist.get_world_size()
    dp_shard = world // (args.dsp * args.dp_replicate)
    mesh = init_device_mesh(device.type, (args.dp_replicate, dp_shard, args.dsp),                     # DSP: a dsp dim
                            mesh_dim_names=("dp_replicate", "dp_shard", "dsp"))
    dsp_plugin.set_topology(dsp_plugin.Topology.from_mesh(mesh))                 # DSP: group=None, the loader's DP
    model = build_model(args).to(device)
    if args.activation_checkpointing:
        model.enable_gradient_checkpointing()           # the model's own; the plan keeps its switches' outputs
    model = dsp_plugin.parallelize(model, group=mesh["dsp"])                     # DSP: the built-in Wan plan
    if args.compile:            # the layers inside each block: the plan's and FSDP's hooks on the block stay eager
        for block in model.blocks:
            for layer in (block.attn1, block.attn2, block.ffn):
                layer.compile(backend=args.compile_backend)
    precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if args.precision == "bf16" else MixedPrecisionPolicy())
    model = fsdp.fully_shard(model, mesh, mp_policy=precision)                   # DSP: FSDP2 over dp_shard x dsp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    config = model.config
    data = WanLatents(args.samples, (config.in_channels, args.frames, args.size, args.size),
                      (args.text_len, config.text_dim), args.seed)
    loader = dsp_dataloader(data, batch_size=args.micro_batch, shuffle=True, seed=args.seed)       # DSP
    log.info("mesh %s; FSDP2 over %s, gradient divide factor %d (the DP size: no loss scaling); %s, "
             "activation checkpointing %s, compile %s", dict(zip(mesh.mesh_dim_names, mesh.shape)),
             fsdp.data_parallel_mesh(mesh), fsdp.gradient_divide_factor(mesh), args.precision,
             "on" if args.activation_checkpointing else "off", "on" if args.compile else "off")
    step = 0
    if args.load_dir:
        step = fsdp_checkpoint.load(args.load_dir, model, optimizer, loader=loader)
        log.info("resumed %s at step %d", args.load_dir, step + 1)
    topology = dsp_plugin.get_topology()
    samples_per_step = args.micro_batch * topology.dp

    def step_fn(batch: list[torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = flow_matching_loss(model, batch, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    if args.compile:  # counting the first step's collectives (a dispatch mode) would keep dynamo off for the run
        log.info(describe_topology(topology))
    else:
        step_fn = log_first_call(step_fn, log=log.info)  # rank 0: the DSP groups, the first step's traffic
    losses: dict[int, float] = {}
    batches = iter(loader)
    while step < args.steps:
        step += 1
        try:
            batch = next(batches)
        except StopIteration:                            # a new epoch: the loader reshuffles
            batches = iter(loader)
            batch = next(batches)
        start = time.perf_counter()
        loss = all_reduce_mean(step_fn(batch), group=topology.dp_group).item()     # mean over data-parallel ranks
        seconds = time.perf_counter() - start
        losses[step] = loss
        log.info("step %d loss %.6f  %.3f s  %.1f samples/s", step, loss, seconds, samples_per_step / seconds)
        if args.save_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            path = fsdp_checkpoint.save(args.save_dir, model, optimizer, step=step, loader=loader)
            log.info("saved %s", path)
    if args.losses_json and dist.get_rank() == 0:
        Path(args.losses_json).write_text(json.dumps(losses))
    return losses


if __name__ == "__main__":
    main()
