"""Train diffusers' Wan transformer with DeepSpeed ZeRO and DSP: a complete script to copy and adapt.

    torchrun --standalone --nproc-per-node 4 examples/train_wan_deepspeed.py --dsp 2 --zero 2 --steps 20
    torchrun --standalone --nproc-per-node 4 examples/train_wan_deepspeed.py --dsp 2 --zero 3 --precision bf16 \\
        --steps 10 --save-dir ckpt --save-every 5
    torchrun --standalone --nproc-per-node 4 examples/train_wan_deepspeed.py --dsp 2 --zero 3 --precision bf16 \\
        --steps 20 --load-dir ckpt                                         # resumes at step 11, bit-exact

What makes it DSP (marked ``# DSP``): the config's two keys, ``initialize`` from ``dsp_plugin.deepspeed``,
``dsp_plugin.parallelize(model)`` (the built-in Wan plan: latents split on frames, the head switch around
self-attention, the output gathered), and the loader from ``initialize`` (every rank of a DSP group gets
the same samples). Everything else is a plain DeepSpeed training loop: flow matching (rectified flow, as Wan
is trained: ``x_t = (1 - s) x0 + s noise``, the model predicts ``noise - x0`` at timestep ``1000 s``), bf16
or fp32, ZeRO 0-3, AdamW with a warm-up then a linear decay (DeepSpeed's ``WarmupDecayLR``), checkpoints with
manifests (``dsp_plugin.deepspeed.checkpoint``: a save never becomes ``latest`` half-written, a mixed or
altered checkpoint is refused) holding Adam's state, the schedule's step, the loader's position and every
rank's RNG states, so a resumed run continues with the same batches and draws. Rank 0 logs the DSP groups
and the first step's traffic (all-to-alls, bytes), then the loss, step time and samples/s of every step.

The data stands in for what you would precompute once with the pipeline's VAE and text encoder:
``WanLatents`` draws latents, text embeddings, noise and the flow time of each sample from its index, so
every rank (and a resumed run) sees the same values. Replace it with your own ``Dataset`` of
``(latents [C, F, H, W], text [L, D], noise [C, F, H, W], sigma [])``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

import dsp_plugin
from dsp_plugin.comm import all_reduce_mean
from dsp_plugin.deepspeed import checkpoint, initialize  # DSP (was: deepspeed.initialize)
from dsp_plugin.failures import launch_main, reporting
from dsp_plugin.launch.cli import argument_errors, usage_error
from dsp_plugin.log import get_logger, setup
from dsp_plugin.paths import check_output_file
from dsp_plugin.steplog import log_first_call

log = get_logger("dsp_plugin.examples.train_wan_deepspeed")
PROG = "train_wan_deepspeed.py"
#: the tiny model's patch (frames, rows, columns) and RoPE positions per axis (build_model)
TINY_PATCH, TINY_ROPE = (1, 2, 2), 32


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line, exit 2, and under torchrun its error file (argparse's own exit writes none)."""
        usage_error(PROG, message, ValueError(message))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random weights) or a WanTransformer3DModel directory")
    p.add_argument("--dsp", type=int, default=2, help="DSP size: ranks sharing one video (default 2)")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="(default bf16)")
    p.add_argument("--steps", type=int, default=10, help="the last optimizer step (default 10)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per data-parallel rank (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's peak learning rate (default 1e-4)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="linear warm-up from --lr / 10 to --lr over these steps (default 2)")
    p.add_argument("--decay-steps", type=int, default=1000,
                   help="then linear decay to 0 at this step (default 1000); not tied to --steps, so a run "
                        "resumed with more --steps continues the same schedule")
    p.add_argument("--samples", type=int, default=64, help="dataset size (default 64)")
    p.add_argument("--frames", type=int, default=5, help="latent frames (default 5)")
    p.add_argument("--size", type=int, default=8, help="latent height and width (default 8)")
    p.add_argument("--text-len", type=int, default=7, help="text tokens (default 7)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    p.add_argument("--save-dir", default=None, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=None, help="save after every N steps (and after the last)")
    p.add_argument("--load-dir", default=None, help="resume from this directory's latest checkpoint")
    p.add_argument("--losses-json", default=None, help="rank 0 writes {step: loss} here")
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective waits for a peer")
    return p.parse_args(argv)


def _model_geometry(model: str) -> tuple[tuple[int, int, int], int | None]:
    """(patch, RoPE positions per axis) of ``--model``: the tiny one's, or a saved model's ``config.json``."""
    if model == "tiny":
        return TINY_PATCH, TINY_ROPE
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model}: no readable config.json ({exc}); expected 'tiny' or a directory "
                         f"written by WanTransformer3DModel.save_pretrained") from None
    return tuple(config.get("patch_size", TINY_PATCH)), config.get("rope_max_seq_len")  # type: ignore[return-value]


def check_args(args: argparse.Namespace, world: int) -> None:
    """Every check that needs only the arguments and files: alike on every rank, before any collective
    (``ValueError`` / ``CheckpointError`` naming the value and what was expected)."""
    for name in ("dsp", "micro_batch", "samples", "frames", "size", "text_len", "save_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    if not 0 < args.timeout < float("inf"):
        raise ValueError(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    if world % args.dsp:
        raise ValueError(f"--dsp {args.dsp} does not divide the world size {world}; expected a divisor of {world}")
    per_step = args.micro_batch * (world // args.dsp)
    if args.samples < per_step:   # the loader would hold no batch: StopIteration at the first step
        raise ValueError(f"--samples {args.samples}: a step takes --micro-batch {args.micro_batch} x "
                         f"{world // args.dsp} data-parallel ranks = {per_step} samples; expected --samples >= "
                         f"{per_step}")
    if args.frames < args.dsp:
        raise ValueError(f"--frames {args.frames} leaves a rank of --dsp {args.dsp} without a frame; expected "
                         f">= {args.dsp}")
    patch, rope = _model_geometry(args.model)
    axes = (("--frames", args.frames, patch[0], "frames"), ("--size", args.size, patch[1], "rows"),
            ("--size", args.size, patch[2], "columns"))
    for flag, value, step, axis in axes:
        if value % step:
            raise ValueError(f"{flag} {value}: the model's patch is {'x'.join(map(str, patch))}, so its {axis} "
                             f"need a multiple of {step}; expected e.g. {flag} {value + step - value % step}")
        if rope is not None and value // step > rope:
            raise ValueError(f"{flag} {value} gives {value // step} tokens along its {axis}, more than the model's "
                             f"rope_max_seq_len {rope}; expected {flag} <= {rope * step}")
    if args.save_every is not None and not args.save_dir:
        raise ValueError("--save-every needs --save-dir")
    if args.save_dir:
        checkpoint.check_save_dir(args.save_dir)
    if args.losses_json:   # rank 0 writes it after training: every rank checks the same path before
        check_output_file("--losses-json", args.losses_json)
    if args.load_dir:
        checkpoint.check_load_dir(args.load_dir)       # a missing, mixed or altered checkpoint
        saved = checkpoint.saved_sizes(args.load_dir)
        if saved["dsp_size"] is not None and saved["dsp_size"] != args.dsp:
            raise ValueError(f"--load-dir {args.load_dir} was saved at --dsp {saved['dsp_size']} on "
                             f"{saved['world_size']} ranks, this run asks --dsp {args.dsp}: its data-parallel "
                             f"ranks, and so the batches and the loader's position, differ; expected --dsp "
                             f"{saved['dsp_size']} (with --nproc-per-node {saved['world_size']}) to resume it, "
                             f"or no --load-dir to start a new run")


def ds_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_mode": "dsp", "sequence_parallel_size": args.dsp,  # DSP: the two keys
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {   # saved and restored with the engine's checkpoint
            "warmup_min_lr": args.lr / 10, "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup_steps,
            "total_num_steps": args.decay_steps, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    if args.model != "tiny":
        return WanTransformer3DModel.from_pretrained(args.model, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)              # the same initial weights on every rank
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, rope_max_seq_len=32)


def flow_matching_loss(engine: Any, batch: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rectified flow: the model at ``x_t = (1 - s) x0 + s noise`` predicts the velocity ``noise - x0``."""
    x0, text, noise, sigma = (t.to(engine.device) for t in batch)
    s = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    prediction = engine(x_t.to(dtype), timestep=sigma * 1000, encoder_hidden_states=text.to(dtype),
                        return_dict=False)[0]
    return torch.nn.functional.mse_loss(prediction.float(), (noise - x0).float())


@launch_main   # torchrun's error file; this rank's error posted for its peers, a peer's named (PeerFailure)
def main(argv: list[str] | None = None) -> dict[int, float]:
    setup()
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with argument_errors(PROG, checkpoint.CheckpointError, OSError):   # one line per rank, exit 2, before any
        check_args(args, world)                                        # collective
    from deepspeed.accelerator import get_accelerator

    from dsp_plugin.deepspeed import skip_cpu_shm_build

    skip_cpu_shm_build()          # DeepSpeed's CPU shared-memory op is a C++ build at start; gloo needs none
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    timeout=datetime.timedelta(seconds=args.timeout))
    try:
        with reporting():   # an error on one rank, in the forward or outside it, reaches the others by name
            return train(args, world)
    finally:
        dsp_plugin.set_topology(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, world: int) -> dict[int, float]:
    model = dsp_plugin.parallelize(build_model(args))                        # DSP: the built-in Wan plan
    config = model.config
    data = WanLatents(args.samples, (config.in_channels, args.frames, args.size, args.size),
                      (args.text_len, config.text_dim), args.seed)
    engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(), training_data=data,
                                      config=ds_config(args, world))         # DSP: initialize, its loader
    step = 0
    if args.load_dir:
        client = checkpoint.load(engine, args.load_dir)           # refuses a missing, mixed or altered one
        loader.load_state_dict(client["loader"])
        step = client["step"]
        log.info("resumed %s at step %d", args.load_dir, step + 1)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    dp_group = engine.mpu.get_data_parallel_group()
    samples_per_step = args.micro_batch * world // args.dsp

    def step_fn(batch: list[torch.Tensor]) -> torch.Tensor:
        loss = flow_matching_loss(engine, batch, dtype)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    step_fn = log_first_call(step_fn, log=log.info)      # rank 0: the DSP groups, the first step's traffic
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
        loss = all_reduce_mean(step_fn(batch), group=dp_group).item()       # mean over data-parallel ranks
        seconds = time.perf_counter() - start
        losses[step] = loss
        log.info("step %d loss %.6f  %.3f s  %.1f samples/s", step, loss, seconds, samples_per_step / seconds)
        if args.save_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            tag = checkpoint.save(engine, args.save_dir, step=step,
                                  client_state={"loader": loader.state_dict(), "step": step})
            log.info("saved %s/%s", args.save_dir, tag)
    if args.losses_json and dist.get_rank() == 0:
        Path(args.losses_json).write_text(json.dumps(losses))
    return losses


if __name__ == "__main__":
    main()
