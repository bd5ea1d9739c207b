"""The paper's STDiT through Megatron's flags: parsed by Megatron, built by ``dsp_plugin.megatron``, stepped by
Megatron's own schedule, DDP and gradient finalisation, on fake tensors.

The config file's ``flags`` are the model (``--num-layers``, ``--hidden-size``, RoPE, adaLN-single,
...); the dry run adds the geometry (``--num-frames``, ``--latent-height/width``: latent patches,
the VAE's 4 channels x the 2 x 2 patch folded into ``--latent-channels``: a patch-2 embedding is a
linear over 16 channels), TP, DSP, bf16 and recompute (``--recompute-granularity full
--recompute-method uniform --recompute-num-layers 1``). ``parallel_state`` is initialised on the
fake process group with DSP in the context-parallel slot; the model goes into Megatron's
``DistributedDataParallel`` (gradients accumulated in an fp32 buffer, reduce-scattered over DP x
DSP with ``--use-distributed-optimizer``, else all-reduced) and one micro-batch runs through
``get_forward_backward_func()`` with ``finalize_model_grads``: the recorded collectives include
Megatron's own gradient reduction. Parameters and gradients are Megatron's buffers; the
optimizer's fp32 master copy and Adam moments (12 bytes an element) are a shard of the buffer
with the distributed optimizer, every element without (Megatron's optimizer itself needs CUDA).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from typing import Any

import torch

from dsp_plugin.bench.params import Hardware
from dsp_plugin.dryrun.models import Geometry, ModelSpec

__all__ = ["dry_run_megatron", "megatron_args", "megatron_step"]


def megatron_argv(setup: Any, spec: ModelSpec, geometry: Geometry) -> list[str]:
    frames, height, width = geometry.latent(spec)
    _, ph, pw = spec.patch
    rows, cols = height // ph, width // pw
    tokens = frames * rows * cols
    argv = [*spec.flags,
            "--tensor-model-parallel-size", str(setup.tp), "--pipeline-model-parallel-size", "1",
            "--latent-channels", str(spec.latent_channels * ph * pw), "--num-frames", str(frames),
            "--latent-height", str(rows), "--latent-width", str(cols),
            "--text-dim", str(spec.text_dim), "--text-len", str(geometry.text_tokens),
            "--seq-length", str(2 * setup.dsp * tokens), "--max-position-embeddings", str(2 * setup.dsp * tokens),
            "--micro-batch-size", str(geometry.batch), "--global-batch-size", str(geometry.batch * setup.dp),
            "--train-iters", "1", "--lr", "1e-4", "--use-cpu-initialization", "--transformer-impl", "local",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1", "--distributed-backend", "gloo"]
    argv += ["--sequence-parallel-mode", "dsp", "--dsp-size", str(setup.dsp)] if setup.dsp > 1 else []
    argv += ["--bf16"] if setup.dtype == "bf16" else []
    argv += ["--use-distributed-optimizer"] if setup.distributed_optimizer else []
    if setup.recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return argv


def megatron_args(argv: list[str], world: int) -> Any:
    """Megatron's own parsing and validation of ``argv`` (with the DSP and model options) for ``world`` ranks."""
    from megatron.training.arguments import parse_args, validate_args

    from dsp_plugin.megatron.pretrain_args import ARGS_DEFAULTS, extra_args_provider

    env = {"WORLD_SIZE": str(world), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # what a launch exports
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in env}
    sys.argv = ["dsp-dryrun", *argv]
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints its arguments
            args = parse_args(extra_args_provider)
            args.rank, args.world_size = 0, world
            validate_args(args, ARGS_DEFAULTS)
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return args


def dry_run_megatron(setup: Any, spec: ModelSpec, geometry: Geometry, hw: Hardware) -> Any:
    """``setup`` on fake tensors as rank 0 of a fake world (``megatron_step`` with ``fake=True``)."""
    from dsp_plugin.fake_world import fake_world

    start = time.perf_counter()
    with fake_world(setup.world, tp=setup.tp, dsp=setup.dsp):
        return megatron_step(setup, spec, geometry, hw, fake=True, start=start)


def megatron_step(setup: Any, spec: ModelSpec, geometry: Geometry, hw: Hardware, *, fake: bool,
                  start: float | None = None) -> Any:
    """One Megatron step of ``setup`` on this rank of the initialised world: fake tensors, or real ones (the
    tests run it on gloo to hold the fake tier against)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.dryrun.estimate import estimate
    from dsp_plugin.dryrun.memory import MemoryTracker
    from dsp_plugin.dryrun.result import DryRun, by_block, group_names, module_name
    from dsp_plugin.megatron.cpu import cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.megatron.steps import build_model, forward_step, model_config_from_args, video_shape_from_args

    start = time.perf_counter() if start is None else start
    world = setup.world
    with cuda_shim(training=True), contextlib.redirect_stdout(io.StringIO()):
        args = megatron_args(megatron_argv(setup, spec, geometry), world)
        topology = initialize_dsp_model_parallel(tp=setup.tp, dsp=setup.dsp, create_gloo_process_groups=False)
        try:
            with FakeTensorMode() if fake else contextlib.nullcontext():
                config = model_config_from_args(args)
                video = video_shape_from_args(args)
                if not fake:
                    torch.manual_seed(0)
                model = build_model(config, video, transformer_impl="local", text_dim=args.text_dim,
                                    text_len=args.text_len)
                ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                           use_distributed_optimizer=setup.distributed_optimizer)
                ddp = DistributedDataParallel(config, ddp_config, model)
                config.finalize_model_grads_func = lambda *a, **k: _paused(tracker, finalize_model_grads, *a, **k)
                config.no_sync_func = ddp.no_sync
                buffers = ddp.buffers + ddp.expert_parallel_buffers
                params_bytes = sum(b.param_data.numel() * b.param_data.element_size() if b.param_data is not None
                                   else sum(p.numel() * p.element_size() for p in b.params) for b in buffers)
                grads_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
                d = ps.get_data_parallel_world_size(with_context_parallel=True)
                elements = sum(b.numel for b in buffers)
                master = elements // d if setup.distributed_optimizer else elements
                parameters = sum(p.numel() for p in model.parameters())
                generator = None if fake else torch.Generator().manual_seed(1)
                batch = _batch(video, geometry, args, dtype=config.params_dtype, generator=generator)
                tracker = MemoryTracker(exclude=[*model.parameters(), *model.buffers(),
                                                 *(b.grad_data for b in buffers)], model=model)
                with CommAccounting() as acct, tracker:
                    saved = []  # the saved bytes at the end of the forward (the step runs inside Megatron)
                    hook = model.register_forward_hook(lambda *_: saved.append(acct.saved_activation_bytes))
                    ddp.zero_grad_buffer()
                    get_forward_backward_func()(
                        forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
                        num_microbatches=1, seq_length=video.tokens, micro_batch_size=geometry.batch,
                        forward_only=False)
                    hook.remove()
                collectives = by_block(acct.records, tracker.collective_sites, group_names(topology))
        finally:
            ps.destroy_model_parallel()
    tokens = video.tokens * geometry.batch
    sharded = "distributed optimizer: fp32 master and Adam moments on 1/" + str(d) if setup.distributed_optimizer \
        else "DDP: fp32 master and Adam moments of every element"
    return DryRun(setup=setup, geometry=geometry.describe(spec), tokens=tokens, parameters=parameters,
                  params_bytes=params_bytes, grads_bytes=grads_bytes, optimizer_bytes=master * 12,
                  activations_bytes=tracker.peak, buffers_bytes=0, step_transient_bytes=0,
                  saved_bytes=saved[0],
                  peak_module=module_name(tracker.peak_module),
                  peak_phase=tracker.peak_phase, flops=float(tracker.flops), collectives=collectives,
                  estimate=estimate(float(tracker.flops), collectives, tp=setup.tp, world=world, hw=hw),
                  framework=f"Megatron DDP (fp32 gradient buffer), {sharded} ({elements:,} elements)",
                  seconds=time.perf_counter() - start)


def _paused(tracker: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Megatron's gradient reduction with the tracker paused (its backend's temporaries are not activations)."""
    with tracker.paused():
        return fn(*args, **kwargs)


def _batch(video: Any, geometry: Geometry, args: Any, *, dtype: torch.dtype,
           generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    b = geometry.batch
    shape = (b, video.channels, video.frames, video.height, video.width)
    batch = {"latents": torch.randn(shape, generator=generator).to(dtype),
             "target": torch.randn(shape, generator=generator).to(dtype),
             "timestep": torch.randint(0, 1000, (b,), generator=generator)}
    if args.text_dim:
        batch["text"] = torch.randn(b, args.text_len, args.text_dim, generator=generator).to(dtype)
    return batch
