"""Train the tiny STDiT with DSP on synthetic video latents; the README's main job.

    torchrun --standalone --nproc-per-node 4 -m dsp_plugin.launch.train_dsp --out out/dsp.json
    python -m dsp_plugin.launch.train_dsp --out out/single.json --compare out/dsp.json

Every rank logs nothing but rank 0, which prints per step: the loss, the step
time, and the all-to-all bytes this rank sent per layer (forward, backward) beside
the formula 2M(N-1)/N^2. Run on one process (no torchrun) it is the reference;
``--compare`` prints both loss curves side by side.

Under torchrun it runs on NCCL and one GPU per process when CUDA is present,
gloo on the CPU otherwise (``dsp_plugin.backend``; ``DSP_BACKEND=gloo`` forces the CPU).

Knobs: ``--dsp`` (default: the whole world, DP = world / DSP), ``--frames``,
``--height``, ``--width``, ``--batch-size`` (per DP rank), ``--steps``, ``--lr``, ``--seed``,
``--timeout`` (seconds a collective waits for a dead or frozen peer; every group inherits it).
Training: ``--optimizer sgd|adamw``, ``--warmup-steps`` and ``--decay-steps`` (a linear warm-up, then a
linear decay to 0). Checkpoints (``dsp_plugin.launch.train_state``): ``--save-dir`` with ``--save-every N``
(and after the last step) keeps the model, the optimizer's state, the schedule, the data position and every
rank's RNG states; ``--load-dir`` resumes from its latest save, equal to the run that was not interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from dsp_plugin import Topology, dsp_dataloader, parallelize, reduce_gradients, set_topology
from dsp_plugin import backend as runtime
from dsp_plugin.accounting import CommAccounting
from dsp_plugin.adapters.sharded import check_divisible_lengths
from dsp_plugin.comm import all_reduce_mean
from dsp_plugin.failures import launch_main, reporting
from dsp_plugin.launch import train_state
from dsp_plugin.launch.cli import argument_errors
from dsp_plugin.log import setup
from dsp_plugin.models import STDiT, STDiTConfig
from dsp_plugin.paths import check_output_dir, check_output_file
from dsp_plugin.plan.builtin import stdit_schedule


class SyntheticLatents(Dataset):
    """Deterministic video latents, timesteps, text embeddings and noise targets."""

    def __init__(self, size: int, shape: tuple[int, int, int, int], text_dim: int, seed: int) -> None:
        self.size, self.shape, self.text_dim, self.seed = size, shape, text_dim, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return {"latents": torch.randn(self.shape, generator=g),
                "timestep": torch.randint(0, 1000, (), generator=g),
                "text": torch.randn(4, self.text_dim, generator=g),
                "target": torch.randn(self.shape, generator=g)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", choices=("tiny", "720M", "3B"),
                   help="the STDiT size: STDiTConfig.preset (default tiny)")
    p.add_argument("--dsp", type=int, default=None, help="DSP size (default: world size)")
    p.add_argument("--frames", type=int, default=8, help="latent frames (default 8)")
    p.add_argument("--height", type=int, default=16, help="latent height (default 16)")
    p.add_argument("--width", type=int, default=16, help="latent width (default 16)")
    p.add_argument("--batch-size", type=int, default=2, help="samples per DP rank per step")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--lr", type=float, default=0.1, help="(peak) learning rate (default 0.1)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"), help="(default sgd)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up to --lr over these steps (default 0)")
    p.add_argument("--decay-steps", type=int, default=0,
                   help="then linear decay to 0 at this step (default 0: no decay); not tied to --steps")
    p.add_argument("--samples", type=int, default=None,
                   help="synthetic samples (default: batch size x DP x steps, one epoch; a run resumed with "
                        "more --steps needs the saving run's number)")
    p.add_argument("--save-dir", type=Path, default=None, help="write checkpoints here (after the last step too)")
    p.add_argument("--save-every", type=int, default=None, help="with --save-dir: save after every N steps")
    p.add_argument("--load-dir", type=Path, default=None, help="resume from this directory's latest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    p.add_argument("--out", type=Path, default=None, help="write the loss curve as JSON")
    p.add_argument("--compare", type=Path, default=None, help="a JSON from another run to compare losses with")
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a collective may wait for a peer before every rank stops (default 120)")
    return p.parse_args()


PROG = "dsp_plugin.launch.train_dsp"


def preflight(args: argparse.Namespace, world: int) -> int:
    """Every check that needs only the arguments, alike on every rank, before any collective; the DSP size.

    Under ``argument_errors`` a failure is one line per rank (``dsp_plugin.launch.train_dsp: error: ...``),
    exit 2, and torchrun's error file names it."""
    dsp = args.dsp if args.dsp is not None else world
    if dsp < 1 or world % dsp:
        raise ValueError(f"--dsp {dsp} does not divide the world size {world}; expected a divisor of {world} "
                         f"(DP = world / DSP)" + ("" if world > 1 else ": one process is DSP 1; launch "
                                                  "with torchrun --nproc-per-node N for more"))
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError(f"--steps {args.steps} and --batch-size {args.batch_size}: expected both >= 1")
    if args.warmup_steps < 0 or args.decay_steps < 0 or 0 < args.decay_steps <= args.warmup_steps:
        raise ValueError(f"--warmup-steps {args.warmup_steps} and --decay-steps {args.decay_steps}: expected "
                         f"both >= 0 and --decay-steps 0 (no decay) or above --warmup-steps")
    if args.save_every is not None and (args.save_every < 1 or not args.save_dir):
        raise ValueError(f"--save-every {args.save_every}: expected a positive number of steps, with --save-dir")
    if args.save_dir:
        check_output_dir("--save-dir", args.save_dir)
    if args.load_dir:
        train_state.check_load_dir(args.load_dir)
    check_divisible_lengths(PROG, {"--frames": args.frames,
                                   "spatial tokens (--height/2)*(--width/2)": (args.height // 2) * (args.width // 2)},
                            dsp)
    if args.out:   # rank 0 writes it; every rank checks (the same shared path), before any collective
        check_output_file("--out", args.out)
    if args.compare and not args.compare.is_file():
        raise ValueError(f"--compare {str(args.compare)!r} is not a file; expected the --out JSON of an earlier run")
    return dsp


@launch_main
def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    with argument_errors(PROG):   # the same arguments on every rank: every rank stops alike, one line each
        preflight(args, world)
    try:
        if distributed:
            device = runtime.init_distributed(timeout_s=args.timeout).device
            set_topology(Topology.build(dsp=args.dsp))   # its groups inherit --timeout
        else:
            device = runtime.choose().device
        with reporting():   # this rank's own error posted for its peers, a peer's named (dsp_plugin.failures)
            run(args, distributed, device)
    finally:
        set_topology(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace, distributed: bool, device: torch.device) -> None:
    from dsp_plugin.topology import get_topology

    topology = get_topology()
    rank = dist.get_rank() if distributed else 0
    dsp = topology.dsp if topology else 1
    dp = topology.dp if topology else 1
    log = setup(stream="stdout").info       # the dsp_plugin logger: rank 0 only (dsp_plugin.log)

    config = STDiTConfig.preset(args.preset)
    torch.manual_seed(args.seed)                   # same initial parameters on every rank
    model = STDiT(config).to(device)
    if dsp > 1:
        parallelize(model)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(done, args))
    shape = (config.in_channels, args.frames, args.height, args.width)
    data = SyntheticLatents(args.samples or args.batch_size * dp * args.steps, shape, config.text_dim or 1, args.seed)
    loader = dsp_dataloader(data, batch_size=args.batch_size, seed=args.seed, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "device": device}
    first = 1
    if args.load_dir:
        first = train_state.load(args.load_dir, **state) + 1

    tokens = args.frames * (args.height // 2) * (args.width // 2)
    m_bytes = args.batch_size * tokens * config.hidden_size * 4     # one [B, T, S, D] fp32 activation
    formula = 2 * m_bytes * (dsp - 1) / dsp**2
    log(f"DSP training: {topology.describe() if topology else 'one process (the reference)'}; on {device}")
    log(f"model {args.preset}: depth {config.depth}, hidden {config.hidden_size}, heads {config.num_heads}; "
        f"latents {list(shape)} per sample, {tokens} tokens, batch {args.batch_size} per DP rank")
    if dsp > 1:
        log("plan: " + "; ".join(stdit_schedule(model)))
    log(f"{'step':>4} | {'loss':>9} | {'step ms':>7} | {'switches fwd/bwd':>16} | {'KiB/switch':>10} | "
        f"{'KiB/layer':>9} | {'2M(N-1)/N^2':>11} | {'grad all-reduce KiB':>19}")
    if args.load_dir:
        log(f"resumed {args.load_dir} at step {first}")
    losses = []
    acct = None
    batches = iter(loader)
    for step in range(first, args.steps + 1):
        try:
            batch = next(batches)
        except StopIteration:   # the next epoch: the loader reshuffles
            batches = iter(loader)
            batch = next(batches)
        batch = {k: v.to(device) for k, v in batch.items()}
        runtime.synchronize(device)
        start = time.perf_counter()
        # Traffic is the same every step: count it on step 1 only, so the other steps are timed
        # without the accounting's dispatch mode (about 10 us per operator).
        with CommAccounting(activations=False) if acct is None else contextlib.nullcontext() as counting:
            out = model(batch["latents"], batch["timestep"], batch["text"])
            loss = torch.nn.functional.mse_loss(out, batch["target"])
            optimizer.zero_grad()
            loss.backward()
            reduce_gradients(model.parameters())
        optimizer.step()
        scheduler.step()
        runtime.synchronize(device)
        elapsed = (time.perf_counter() - start) * 1e3
        acct = counting if counting is not None else acct
        if dp > 1:  # report the global-batch loss, as the single process sees it
            loss = all_reduce_mean(loss.detach(), group=topology.dp_group)
        losses.append(loss.item())
        switches = acct.select("all_to_all", "forward")
        per_switch = switches[0].bytes_sent / 1024 if switches else 0.0
        log(f"{step:>4} | {losses[-1]:>9.6f} | {elapsed:>7.1f} | "
            f"{len(switches):>7}/{acct.count('all_to_all', 'backward'):<8} | {per_switch:>10.1f} | "
            f"{2 * per_switch:>9.1f} | {formula / 1024:>11.1f} | {acct.bytes_sent('all_reduce') / 1024:>19.1f}")
        if args.save_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            log(f"saved {train_state.save(args.save_dir, step, **state)}")
    log("Traffic counted on step 1 (the same every step); step 1's time includes that counting and the "
        "ranks' first-call agreement (dsp_plugin.checks).")
    if dsp > 1:
        log(f"KiB are sent by this rank. A layer is two switches (before its spatial and its temporal "
            f"block); layer 0 needs only one because the split lands on T: {2 * config.depth - 1} in all.")
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world": dsp * dp, "dsp": dsp, "first_step": first, "losses": losses}))
    if rank == 0 and args.compare:
        other = json.loads(args.compare.read_text())
        log(f"\nloss curve: this run ({dsp * dp} process(es)) against {args.compare} "
            f"({other['world']} processes, DSP {other['dsp']})")
        log(f"{'step':>4} | {'this run':>10} | {'other run':>10} | {'|diff|':>9}")
        for step, (a, b) in enumerate(zip(losses, other["losses"]), start=1):
            log(f"{step:>4} | {a:>10.6f} | {b:>10.6f} | {abs(a - b):>9.2e}")
        log(f"largest difference: {max(abs(a - b) for a, b in zip(losses, other['losses'])):.2e}")


def lr_factor(done: int, args: argparse.Namespace) -> float:
    """The learning rate of the step after ``done`` steps, as a fraction of ``--lr``."""
    step = done + 1
    if step <= args.warmup_steps:
        return step / args.warmup_steps
    if args.decay_steps:
        return max(0.0, (args.decay_steps - step) / (args.decay_steps - args.warmup_steps))
    return 1.0


if __name__ == "__main__":
    main()
