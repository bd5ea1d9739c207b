"""Pretrain the spatial-temporal DiT on synthetic video latents with megatron.training and DSP.

    torchrun --nproc-per-node 4 -m dsp_plugin.launch.pretrain_stdit --sequence-parallel-mode dsp --dsp-size 4 ...

(``launch/run_megatron.sh`` fills in the rest from environment variables.)

On a GPU machine this is a plain Megatron launch: ``parse_and_validate_args``
with the DSP ``extra_args_provider``, then ``megatron.training.pretrain()``
with this file's dataset provider, model provider and forward step.

On CPU (gloo) ``pretrain()`` itself cannot run: ``initialize_megatron`` asserts
CUDA and, without GPUs, skips ``initialize_model_parallel``; ``pretrain`` then
all-reduces start-up timestamps and warms up torch.compile'd fusions; its
``train()`` loop logs CUDA memory. ``cpu_pretrain`` runs the same sequence with
Megatron's own functions (see docs/megatron.md for the exact list):

1. ``parse_and_validate_args`` (real, with the DSP provider);
2. ``init_process_group("gloo")`` and ``initialize_model_parallel`` with DSP in the
   CP slot: what ``_initialize_distributed`` does when it finds GPUs;
3. ``initialize_megatron(allow_no_cuda=True)``: seeds, rerun state machine,
   autoresume, dataset helpers (real);
4. ``setup_model_and_optimizer`` (real: ``get_model`` with this file's model
   provider, megatron-core DDP, Megatron's optimizer and LR scheduler);
5. ``build_train_valid_test_data_iterators`` (real Megatron samplers and loaders);
6. ``train_step`` (real) per iteration, with the config ``train()`` sets up.

``dsp_plugin.megatron.cpu.cuda_shim`` answers the CUDA device queries these make.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator

import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from dsp_plugin.megatron.arguments import add_dsp_arguments  # noqa: E402
from dsp_plugin.megatron.compat import use_prebuilt_dataset_helpers  # noqa: E402
from dsp_plugin.megatron.flops import install_flops_formula  # noqa: E402
from dsp_plugin.megatron.steps import (  # noqa: E402
    SyntheticVideoDataset,
    add_model_arguments,
    forward_step,
    model_provider,
    video_shape_from_args,
)

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer", "vocab_size": 1}


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DSP options (the flag) plus the latent video geometry of the synthetic data."""
    return escape_help_percents(add_model_arguments(add_dsp_arguments(parser)))


def escape_help_percents(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--help`` formats every help string with ``%``; megatron-core has a bare one ("10%") that crashes it."""
    import re

    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            # keep "%%" and "%(default)s"; double a bare "%"
            action.help = re.sub(r"%(%|\(\w+\)[a-z])?", lambda m: m.group(0) if m.group(1) else "%%", action.help)
    return parser


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None,
                                       ) -> tuple[SyntheticVideoDataset, ...]:
    """Synthetic latents (train, validation, test splits with their own seeds); every rank builds its own
    copy (deterministic, nothing to broadcast)."""
    args = get_args()
    video, text = video_shape_from_args(args), {"text_dim": args.text_dim or None, "text_len": args.text_len}
    return tuple(SyntheticVideoDataset(video, max(n, 1), seed=args.seed + split, **text)
                 for split, n in enumerate(train_val_test_num_samples))


train_valid_test_datasets_provider.is_distributed = True


@contextlib.contextmanager
def exit_is_failure(what: str) -> Iterator[None]:
    """Megatron calls ``sys.exit()`` (status 0) on some load errors; a run that did not train must fail."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise RuntimeError(f"{what} called sys.exit() without an error status; see the message above") from exc
        raise


def cpu_pretrain(args: argparse.Namespace) -> list[float]:
    """``pretrain()``'s sequence on gloo; returns the losses it logged (last stage)."""
    from datetime import timedelta

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (
        build_train_valid_test_data_iterators,
        evaluate_and_print_results,
        setup_model_and_optimizer,
        train_step,
    )

    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.flops import num_floating_point_operations
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.steplog import log_first_call
    from dsp_plugin.topology import set_topology

    needs_cuda = [flag for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                        ("--bf16", args.bf16), ("--fp16", args.fp16)) if on]
    if needs_cuda:  # checked on every rank before any collective
        raise ValueError(f"{', '.join(needs_cuda)}: needs CUDA, Megatron's distributed and mixed-precision optimizers "
                         "assert torch.cuda tensor types; on CPU drop them (the model itself is tested in bf16 "
                         "and fp16 under Float16Module by tests/test_megatron_precision.py)")
    install_cuda_shim()
    torch.set_num_threads(int(os.getenv("OMP_NUM_THREADS", "1")))
    torch.distributed.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                                         timeout=timedelta(minutes=args.distributed_timeout_minutes))
    losses: list[float] = []
    try:
        # what _initialize_distributed does with GPUs (it skips model parallelism without them)
        initialize_dsp_model_parallel(tp=args.tensor_model_parallel_size, dsp=args.context_parallel_size,
                                      pp=args.pipeline_model_parallel_size,
                                      timeout_minutes=args.distributed_timeout_minutes)
        initialize_megatron(allow_no_cuda=True)
        # what _set_random_seed does when it finds GPUs: the RNG tracker checkpoints save and load
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        with exit_is_failure("loading the checkpoint"):
            model, optimizer, scheduler = setup_model_and_optimizer(
                ModelType.encoder_or_decoder, model_provider, cfg_container=pretrain_cfg_container_from_args(args))
        config = get_model_config(model[0])  # what train() sets before its loop
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        train_iter, valid_iter, _ = build_train_valid_test_data_iterators(train_valid_test_datasets_provider)
        flops_so_far = getattr(args, "num_floating_point_operations_so_far", 0)
        first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 \
            and ps.get_context_parallel_rank() == 0
        iteration = args.iteration
        logged_step = log_first_call(train_step, log=print_rank_0)  # groups, all-to-alls, bytes of step 1
        if iteration >= args.train_iters:
            print_rank_0(f"> the checkpoint is at iteration {iteration} >= --train-iters {args.train_iters}: "
                         "nothing to train (raise --train-iters to go on)")
        while iteration < args.train_iters:
            start = time.time()
            loss_dict, *_ = logged_step(forward_step, train_iter, model, optimizer, scheduler, config,
                                       get_forward_backward_func(), iteration=iteration)
            iteration += 1
            args.curr_iteration = iteration
            args.consumed_train_samples += args.global_batch_size
            flops = num_floating_point_operations(args, args.global_batch_size)
            flops_so_far += flops
            elapsed = time.time() - start
            if "loss" in loss_dict:
                losses.append(float(loss_dict["loss"]))
                if first:
                    print(f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
                          f"{args.consumed_train_samples:12d} | elapsed time per iteration (ms): "
                          f"{1000 * elapsed:.1f} | throughput per GPU (TFLOP/s/GPU): "
                          f"{flops / (elapsed * args.world_size * 1e12):.6f} | "
                          f"learning rate: {scheduler.get_lr(optimizer.param_groups[0]):.6E} | "
                          f"global batch size: {args.global_batch_size:5d} | loss: {losses[-1]:.9E} |",
                          flush=True)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save_checkpoint(iteration, model, optimizer, scheduler, flops_so_far)
            if args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0:
                evaluate_and_print_results(f"iteration {iteration}", forward_step, valid_iter, model, iteration,
                                           None, config, verbose=False, write_to_tensorboard=False)
        if args.save and iteration > args.iteration and not (args.save_interval
                                                             and iteration % args.save_interval == 0):
            save_checkpoint(iteration, model, optimizer, scheduler, flops_so_far)
        if args.eval_iters and iteration > 0:  # pretrain() evaluates once more after training
            evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step, valid_iter,
                                       model, iteration, None, config, verbose=False, write_to_tensorboard=False)
        return losses
    finally:
        ps.destroy_model_parallel()
        set_topology(None)
        torch.distributed.destroy_process_group()


def main() -> None:
    if not torch.cuda.is_available():
        from dsp_plugin.megatron.cpu import install_cuda_shim

        install_cuda_shim()  # validate_args asks for the device architecture
    use_prebuilt_dataset_helpers()  # the megatron-core wheel has no Makefile for them
    install_flops_formula()  # throughput in this model's FLOPs, not the GPT formula
    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=ARGS_DEFAULTS)
    print_rank_0(f"> sequence parallel mode: {args.sequence_parallel_mode}, dsp size {args.dsp_size} "
                 f"(Megatron context-parallel slot), tp {args.tensor_model_parallel_size}, "
                 f"pp {args.pipeline_model_parallel_size}, dp {args.data_parallel_size}")
    if torch.cuda.is_available():
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    else:
        with exit_is_failure("training"):
            cpu_pretrain(args)


if __name__ == "__main__":
    main()
