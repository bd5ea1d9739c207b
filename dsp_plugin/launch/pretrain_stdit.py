"""Pretrain the spatial-temporal DiT on synthetic video latents with megatron.training and DSP.

    torchrun --nproc-per-node 4 -m dsp_plugin.launch.pretrain_stdit --sequence-parallel-mode dsp --dsp-size 4 ...

(``launch/run_megatron.sh`` fills in the rest from environment variables.)

A plain Megatron launch on every machine: ``parse_and_validate_args`` with the
DSP ``extra_args_provider``, then ``megatron.training.pretrain()`` (and so its
``train()``) with this file's dataset provider, model provider and forward step.

Without CUDA the same ``pretrain()`` runs on gloo (``--distributed-backend gloo``)
under ``dsp_plugin.megatron.cpu.cuda_shim(training=True)``, which answers only
the device queries Megatron makes (``is_available``, ``device_count``, memory
counters, ``synchronize``, ``device="cuda"`` tensors -> CPU; see its docstring).
No training loop of ours: every ``train()`` option (``--log-interval``,
``--exit-interval``, ``--exit-duration-in-mins``, ``--tensorboard-dir``,
evaluation, ``--save/--load``, ``--overlap-grad-reduce``) is Megatron's own.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsp_plugin.failures import launch_main

if TYPE_CHECKING:
    from dsp_plugin.megatron.steps import SyntheticVideoDataset

# megatron.training and this package's Megatron modules are imported where they are used, not here: Megatron's
# first torch_dist save starts a result-queue Manager with multiprocessing's spawn, which imports this module
# again in a new process per rank (``__mp_main__``); with the imports at the top that took 7 s of CPU per rank.

def train_valid_test_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None,
                                       ) -> tuple[SyntheticVideoDataset | None, ...]:
    """Synthetic latents (train, validation, test splits with their own seeds) of the sizes Megatron asks
    for; a split of 0 samples is None (no loader, as Megatron's own builders do), so a resume without
    ``--eval-iters`` does not build a validation sampler behind the checkpoint's consumed samples. Every
    rank builds its own copy (deterministic, nothing to broadcast)."""
    from megatron.training import get_args

    from dsp_plugin.megatron.steps import SyntheticVideoDataset, video_buckets_from_args, video_shape_from_args

    args = get_args()
    video, text = video_shape_from_args(args), {"text_dim": args.text_dim or None, "text_len": args.text_len,
                                                "varying_captions": args.varying_captions,
                                                "buckets": video_buckets_from_args(args),
                                                "bucket_size": args.global_batch_size}
    return tuple(SyntheticVideoDataset(video, n, seed=args.seed + split, **text) if n > 0 else None
                 for split, n in enumerate(train_val_test_num_samples))


train_valid_test_datasets_provider.is_distributed = True


def refuse_cuda_only_options(args: argparse.Namespace) -> None:
    """Without CUDA: options whose Megatron code asserts CUDA tensors (every rank, before any collective)."""
    needs_cuda = [flag for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                        ("--bf16", args.bf16), ("--fp16", args.fp16)) if on]
    if needs_cuda:
        raise ValueError(f"{', '.join(needs_cuda)}: needs CUDA, Megatron's distributed and mixed-precision optimizers "
                         "assert torch.cuda tensor types; on CPU drop them (the model itself is tested in bf16 "
                         "and fp16 under Float16Module by tests/test_megatron_precision.py)")
    if args.distributed_backend != "gloo":
        raise ValueError(f"--distributed-backend {args.distributed_backend}: there is no CUDA here; use gloo "
                         "(launch/run_megatron.sh picks it)")


@contextlib.contextmanager
def close_process_group_on_success() -> Iterator[None]:
    """After ``pretrain()`` returns, or ``train()`` ``sys.exit(0)``s at ``--exit-interval`` or
    ``--exit-duration-in-mins``, every rank is at the same point: meet once more and destroy the process
    group, rather than leave gloo's teardown to interpreter shutdown, where a rank that exits first can
    abort its peer. A failing rank skips this (no collective after an error)."""
    from dsp_plugin.comm import meet_and_close

    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            meet_and_close()
        raise
    meet_and_close()


PROG = "dsp_plugin.launch.pretrain_stdit"


@launch_main
def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, print_rank_0
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from dsp_plugin.launch.cli import argument_errors
    from dsp_plugin.megatron.compat import (
        agree_on_query_groups,
        data_iterators_leave_rng_alone,
        fail_on_silent_exit_in_load,
        reset_log_on_first_boundary,
        use_prebuilt_dataset_helpers,
    )
    from dsp_plugin.megatron.cpu import cuda_is_real, cuda_shim
    from dsp_plugin.megatron.flops import install_flops_formula
    from dsp_plugin.megatron.pretrain_args import ARGS_DEFAULTS, extra_args_provider
    from dsp_plugin.megatron.resume import check_load_path
    from dsp_plugin.megatron.steps import forward_step, model_provider
    from dsp_plugin.paths import check_output_dir

    with contextlib.ExitStack() as stack:
        if not cuda_is_real():  # validate_args asks for the device architecture, pretrain() for CUDA
            stack.enter_context(cuda_shim(training=True))
        use_prebuilt_dataset_helpers()  # the megatron-core wheel has no Makefile for them
        fail_on_silent_exit_in_load()  # Megatron's loader sys.exit()s with status 0 on some errors
        reset_log_on_first_boundary()  # --log-interval 1: every line its own iteration's loss (issue 48)
        data_iterators_leave_rng_alone()  # a resume draws the dropout seeds the uninterrupted run drew
        install_flops_formula()  # throughput in this model's FLOPs, not the GPT formula
        args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=ARGS_DEFAULTS)
        agree_on_query_groups(args)  # rank 0 would change it alone at the first log: every save warned
        with argument_errors(PROG):   # one line per rank, exit 2, torchrun's error file names it
            fresh = check_load_path(args)  # --load of nothing is refused unless it is --save (auto-resume)
            if not cuda_is_real():
                refuse_cuda_only_options(args)
            if args.save:   # every rank writes its part of a checkpoint: every rank checks, before pretrain()
                check_output_dir("--save", args.save)
        if fresh:
            print_rank_0(f"> {fresh}")
        print_rank_0(f"> sequence parallel mode: {args.sequence_parallel_mode}, dsp size {args.dsp_size} "
                     f"(Megatron context-parallel slot), tp {args.tensor_model_parallel_size}, "
                     f"pp {args.pipeline_model_parallel_size}, dp {args.data_parallel_size}")
        stack.enter_context(log_first_train_step())
        with close_process_group_on_success():
            pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                     ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)


@contextlib.contextmanager
def log_first_train_step() -> Iterator[None]:
    """Log the DSP groups and iteration 1's all-to-alls and bytes (``dsp_plugin.steplog``), as ``make train`` does.

    ``train()`` looks ``train_step`` up in its module at every iteration, so wrapping that
    name counts the first call and leaves the rest untouched; restored on exit.
    """
    from megatron.training import print_rank_0, training

    from dsp_plugin.megatron.groups import topology_from_parallel_state
    from dsp_plugin.steplog import log_first_call

    original = training.train_step
    training.train_step = log_first_call(original, log=print_rank_0, topology=topology_from_parallel_state)
    try:
        yield
    finally:
        training.train_step = original


if __name__ == "__main__":
    main()
