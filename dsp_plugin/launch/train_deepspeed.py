"""Train the tiny STDiT with DeepSpeed and DSP on synthetic video latents (CPU/gloo by default).

What DSP changes in a DeepSpeed script, all three marked ``# DSP`` below: the
config carries the key (``launch/ds_config_dsp.json``), ``initialize`` comes from
``dsp_plugin.deepspeed``, and the model is made DSP-aware (``parallelize`` for
this STDiT). Precision follows the config (``"bf16"``/``"fp16"``): inputs are
cast to the parameters' dtype and the loss is taken in fp32::

    deepspeed --num_gpus 4 --module dsp_plugin.launch.train_deepspeed --deepspeed_config launch/ds_config_dsp.json
    torchrun --standalone --nproc_per_node 4 -m dsp_plugin.launch.train_deepspeed --deepspeed_config launch/ds_config_dsp.json

Prints ``step N loss X`` (mean over data-parallel replicas) on rank 0.
``--save-dir`` with ``--save-at N`` (or ``--save-every N``) writes an engine
checkpoint with the data loader's position as client state, each save under its
own tag with ``latest`` written last (``dsp_plugin.deepspeed.checkpoint``);
``--load-dir`` resumes from ``latest``, at any DSP size that keeps the world size
(ZeRO >= 1) or at any world size (ZeRO-0), and refuses a missing directory or a
checkpoint whose files come from different saves. Bad arguments (a config
without the DSP key, ``--frames`` below the DSP size, an unwritable
``--save-dir``) stop every rank before any collective. ``--timeout`` (seconds,
default 120) bounds every collective's wait for a dead or frozen peer; the DSP
groups inherit it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from dsp_plugin import parallelize
from dsp_plugin.adapters.sharded import check_divisible_lengths
from dsp_plugin.comm import all_reduce_mean
from dsp_plugin.deepspeed import checkpoint, initialize  # DSP (was: deepspeed.initialize)
from dsp_plugin.deepspeed.config import require_dsp_config
from dsp_plugin.deepspeed.engine import load_config
from dsp_plugin.failures import launch_main, reporting
from dsp_plugin.launch.cli import argument_errors, warn_renamed
from dsp_plugin.log import setup
from dsp_plugin.models import STDiT, STDiTConfig
from dsp_plugin.paths import check_output_file
from dsp_plugin.steplog import log_first_call
from dsp_plugin.topology import set_topology


def synthetic_dataset(samples: int, frames: int, size: int, seed: int = 7) -> torch.utils.data.TensorDataset:
    """Latents, timesteps, text embeddings and denoising targets; no downloads."""
    g = torch.Generator().manual_seed(seed)
    shape = (samples, 4, frames, size, size)
    return torch.utils.data.TensorDataset(torch.randn(shape, generator=g),
                                          torch.randint(0, 1000, (samples,), generator=g),
                                          torch.randn(samples, 3, 16, generator=g), torch.randn(shape, generator=g))


#: the old underscore spellings of this script's own flags (DeepSpeed's --deepspeed_config keeps DeepSpeed's)
RENAMED = {"--save_dir": "--save-dir", "--save_at": "--save-at", "--save_every": "--save-every",
           "--load_dir": "--load-dir", "--losses_json": "--losses-json"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--samples", type=int, default=64, help="synthetic dataset size (default 64)")
    parser.add_argument("--frames", type=int, default=8, help="latent frames (default 8)")
    parser.add_argument("--size", type=int, default=8, help="latent height and width")
    parser.add_argument("--save-dir", "--save_dir", dest="save_dir", default=None,
                        help="write checkpoints here (dsp_plugin.deepspeed.checkpoint)")
    parser.add_argument("--save-at", "--save_at", dest="save_at", type=int, default=None,
                        help="optimizer step after which to save")
    parser.add_argument("--save-every", "--save_every", dest="save_every", type=int, default=None,
                        help="save after every N optimizer steps")
    parser.add_argument("--load-dir", "--load_dir", dest="load_dir", default=None,
                        help="resume from this directory's latest checkpoint")
    parser.add_argument("--losses-json", "--losses_json", dest="losses_json", default=None,
                        help="rank 0 writes the loss curve here")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a collective may wait for a peer before every rank stops (default 120)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    warn_renamed("dsp_plugin.launch.train_deepspeed", sys.argv[1:], RENAMED)
    if args.deepspeed_config is None:      # a pip install has no launch/: the example config ships in the package
        args.deepspeed_config = str(Path(__file__).with_name("ds_config_dsp.json"))
    return args


PROG = "dsp_plugin.launch.train_deepspeed"


def preflight(args: argparse.Namespace) -> None:
    """Every check that needs only the arguments, on every rank alike, before any collective."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = require_dsp_config(load_config(args), world_size=world, who=PROG)
    check_divisible_lengths(PROG,
                            {"--frames": args.frames, "spatial tokens (--size/2)**2": (args.size // 2) ** 2},
                            settings.size)
    if args.save_dir:
        checkpoint.check_save_dir(args.save_dir)
    if args.losses_json:   # rank 0 writes it; every rank checks (the same shared path), before any collective
        check_output_file("--losses-json", args.losses_json)
    if args.load_dir:
        checkpoint.check_load_dir(args.load_dir)


@launch_main
def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # a bad argument: one line per rank, exit 2, and torchrun's error file names it
    with argument_errors(PROG, checkpoint.CheckpointError, OSError):
        preflight(args)
    try:
        with reporting():   # this rank's own error posted for its peers, a peer's named (dsp_plugin.failures)
            train(args)
    finally:  # also on an error: no gloo work left for interpreter exit, no topology left installed
        set_topology(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    from deepspeed.accelerator import get_accelerator

    from dsp_plugin.deepspeed import skip_cpu_shm_build

    skip_cpu_shm_build()
    # The process group with the user's timeout (DeepSpeed's default is minutes); initialize reuses it.
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = parallelize(STDiT(STDiTConfig.preset("tiny")))  # DSP: the built-in plan's split / switch / gather hooks
    data = synthetic_dataset(args.samples, args.frames, args.size)
    engine, _, loader, _ = initialize(args=args, model=model, model_parameters=model.parameters(),
                                      training_data=data)
    if args.load_dir:
        client = checkpoint.load(engine, args.load_dir)  # refuses a missing or mixed checkpoint
        loader.load_state_dict(client["loader"])
    rank, gas = dist.get_rank(), engine.gradient_accumulation_steps()
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else torch.float32
    batches = iter(loader)
    losses = []

    def micro_step(batch: list[torch.Tensor]) -> torch.Tensor:
        latents, timestep, text, target = (t.to(engine.device) for t in batch)
        prediction = engine(latents.to(dtype), timestep, text.to(dtype))
        loss = torch.nn.functional.mse_loss(prediction.float(), target)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    # rank 0 logs the DSP groups and the first micro-step's all-to-alls and bytes
    log = setup(stream="stdout").info       # the dsp_plugin logger: rank 0 only (dsp_plugin.log)
    micro_step = log_first_call(micro_step, log=log)
    for step in range(1, args.steps + 1):
        total = torch.zeros((), device=engine.device)
        for _ in range(gas):
            try:
                batch = next(batches)
            except StopIteration:  # next epoch: the loader reshuffles
                batches = iter(loader)
                batch = next(batches)
            total += micro_step(batch) / gas
        # Mean over data-parallel replicas (DSP ranks of a group hold the same loss).
        losses.append(all_reduce_mean(total, group=engine.mpu.get_data_parallel_group()).item())
        log(f"step {step} loss {losses[-1]:.6f}")
        if args.save_dir and (args.save_at == step or (args.save_every and step % args.save_every == 0)):
            tag = checkpoint.save(engine, args.save_dir, step=step, client_state={"loader": loader.state_dict()})
            log(f"saved {args.save_dir}/{tag}")
    if rank == 0 and args.losses_json:
        Path(args.losses_json).write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
