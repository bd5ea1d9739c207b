"""``initialize``: ``deepspeed.initialize`` with the same signature and return value, plus DSP.

Moving a DeepSpeed script to DSP takes three changes (docs/deepspeed.md):

1. the config key: ``"sequence_parallel_mode": "dsp"`` next to ``"sequence_parallel_size": N``;
2. ``from dsp_plugin.deepspeed import initialize`` in place of ``deepspeed.initialize``;
3. a DSP-aware model: its forward must shard the sequence with ``split`` /
   ``dynamic_switch`` / ``gather`` (``dsp_plugin.parallelize`` does it from outside
   with a plan: built in for Wan, CogVideoX, Latte, SVD, STDiT; or your own; or the
   model calls the primitives itself). A model
   that does not is caught at its first forward (``guard.py``).

With the key, ``initialize``, in order:

1. checks the config, the DeepSpeed version and the model on every rank before any
   collective (``config.parse_dsp_config``; pipeline models, quantized gradients and
   TP are refused);
2. initialises torch.distributed through DeepSpeed, skipping the CPU shared-memory
   op that only inference uses (``skip_cpu_shm_build``);
3. builds ``Topology(tp=1, dsp=sequence_parallel_size)`` and installs it, so the
   primitives' ``group=None`` is the DSP group;
4. for ZeRO-3, casts the parameters to the configured precision and partitions them
   over DP x DSP, and registers the gradient scale that makes every stage sum over
   DSP and average over DP (``gradients.py``);
5. installs the first-forward guard (``guard.py``), whose collectives run on the
   engine's device (``engine.device``: the GPU ``deepspeed.initialize`` binds,
   ``cuda:LOCAL_RANK``), and the hook that gives every parameter a (zero)
   gradient on every rank (``gradients.install_every_gradient``);
6. calls ``deepspeed.initialize`` with a ``DeepSpeedMPU`` so ZeRO partitions and
   reduces over DP x DSP and the batch arithmetic counts DP only;
7. returns ``training_data`` wrapped in ``dsp_dataloader`` (identical batches
   inside a DSP group, different across DP) instead of DeepSpeed's loader.

Without the key every argument goes to ``deepspeed.initialize`` untouched and
nothing of DeepSpeed's is changed before it.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from dsp_plugin.data import dsp_dataloader
from dsp_plugin.deepspeed.config import DSPSettings, parse_dsp_config
from dsp_plugin.deepspeed.gradients import (fetch_persistent_at_entry, gradient_scale, install_every_gradient,
                                            install_gradient_scale, partition_for_zero3)
from dsp_plugin.deepspeed.guard import install_guard
from dsp_plugin.deepspeed.mpu import DeepSpeedMPU
from dsp_plugin.deepspeed_env import require_tested_deepspeed, skip_cpu_shm_build
from dsp_plugin.topology import Topology, set_topology

__all__ = ["EVERY_GRADIENT_ENV", "initialize", "load_config", "skip_cpu_shm_build"]

#: ``0`` skips ``gradients.install_every_gradient`` (for a model that uses every parameter on every rank).
EVERY_GRADIENT_ENV = "DSP_DEEPSPEED_EVERY_GRADIENT"

def load_config(args: Any = None, config: Any = None, config_params: Any = None) -> dict[str, Any]:
    """The config dict DeepSpeed will read, found the way ``deepspeed.initialize`` finds it."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    if config is None:
        config = config_params
    for attr in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, attr, None) is not None:
            config = getattr(args, attr)
    if config is None:
        raise ValueError("DeepSpeed requires a config: pass config=... or --deepspeed_config")
    return dict(load_ds_config(config))


def _known_world_size() -> int | None:
    if dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def _destroy_at_exit() -> None:
    # Some CPU (gloo) runs aborted at interpreter exit while the group was alive.
    if dist.is_initialized():
        dist.destroy_process_group()


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize``; DSP when the config says ``"sequence_parallel_mode": "dsp"``."""
    passthrough = {"args": args, "model": model, "optimizer": optimizer, "model_parameters": model_parameters,
                   "lr_scheduler": lr_scheduler, "distributed_port": distributed_port,
                   "dist_init_required": dist_init_required, "collate_fn": collate_fn, "config": config,
                   "config_params": config_params}
    settings = parse_dsp_config(load_config(args, config, config_params), world_size=_known_world_size())
    if settings is None:
        return deepspeed.initialize(training_data=training_data, mpu=mpu, mesh_param=mesh_param, **passthrough)
    require_tested_deepspeed()
    _refuse_pipeline(model)
    _set_comm_dtype(model, settings.comm_dtype)
    if mpu is not None:
        raise ValueError("dsp_plugin.deepspeed.initialize: 'sequence_parallel_mode': 'dsp' supplies its own "
                         "mpu; do not pass mpu= as well")
    if mesh_param is not None:
        raise ValueError(f"dsp_plugin.deepspeed.initialize: 'sequence_parallel_mode': 'dsp' cannot be combined "
                         f"with DeepSpeed's Ulysses mesh (mesh_param={mesh_param!r})")
    return _initialize_dsp(settings, training_data=training_data, **passthrough)


def _set_comm_dtype(model: Any, comm_dtype: str | None) -> None:
    """``sequence_parallel_comm_dtype``: the wire format of every plan runtime in ``model`` (``parallelize``'s
    ``comm_dtype=``, read at each switch). Checked on every rank before any collective: a model with no plan
    runtime (one calling the primitives itself passes ``comm_dtype=`` to them) or one parallelized with another
    ``comm_dtype`` is refused."""
    if comm_dtype is None or not isinstance(model, torch.nn.Module):   # no model: _initialize_dsp names that
        return
    from dsp_plugin.comm.payload import as_payload
    from dsp_plugin.deepspeed.config import COMM_DTYPE_KEY

    where = f"dsp_plugin.deepspeed.initialize: {COMM_DTYPE_KEY!r}: {comm_dtype!r}"
    wire = as_payload(where, comm_dtype)
    runtimes = [m._dsp_plan_runtime for m in model.modules() if getattr(m, "_dsp_plan_runtime", None) is not None]
    if not runtimes:
        raise ValueError(f"{where} applies to a model made parallel by dsp_plugin.parallelize, but this "
                         f"{type(model).__name__} has none; call parallelize(model) first, or pass comm_dtype= to "
                         f"the primitives your model calls and drop the key")
    for rt in runtimes:
        if rt.comm_dtype is not None and rt.comm_dtype != wire:
            raise ValueError(f"{where}, but the model was parallelized with comm_dtype={rt.comm_dtype!r}; "
                             f"expected one setting (drop one of the two)")
        rt.comm_dtype = wire


def _refuse_pipeline(model: Any) -> None:
    """A ``PipelineModule`` would get DeepSpeed's pipeline engine, which DSP does not drive (pp = 1 here)."""
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise ValueError("dsp_plugin.deepspeed.initialize: 'sequence_parallel_mode': 'dsp' does not support "
                         "DeepSpeed's pipeline engine (got a deepspeed.pipe.PipelineModule; tp = pp = 1 in the "
                         "DeepSpeed integration); pass a plain torch.nn.Module, or use the Megatron integration "
                         "for PP x DSP")


def _initialize_dsp(settings: DSPSettings, *, training_data: Any, scale: float | None = None,
                    zero3_partition: bool = True, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """The DSP path of ``initialize``.

    ``scale`` overrides the per-stage gradient scale and ``zero3_partition=False``
    leaves ZeRO-3's partitioning to DeepSpeed: both only to measure DeepSpeed's
    own behaviour (``tests/test_deepspeed_convention.py``).
    """
    if kwargs["model"] is None:
        raise ValueError("dsp_plugin.deepspeed.initialize requires a model")
    config = load_config(kwargs["args"], kwargs["config"], kwargs["config_params"])
    created = not dist.is_initialized()
    from deepspeed.accelerator import get_accelerator

    skip_cpu_shm_build()
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    distributed_port=kwargs["distributed_port"],
                                    dist_init_required=kwargs["dist_init_required"])
    if created:
        atexit.register(_destroy_at_exit)
    # The world is known now: re-check (raises on every rank, before any collective).
    parse_dsp_config(config, world_size=dist.get_world_size())
    topology = Topology.build(tp=1, dsp=settings.size)
    set_topology(topology)
    mpu = DeepSpeedMPU(topology)
    if settings.zero_stage == 3 and zero3_partition:
        partition_for_zero3(kwargs["model"], topology, config, mpu)
    install_gradient_scale(kwargs["model"], gradient_scale(settings) if scale is None else scale)
    # The guard's collectives run on the engine's device: the GPU deepspeed.initialize binds (args.device_rank, else
    # LOCAL_RANK). It is not bound yet here: reading the current device now gives cuda:0 on every rank of a node,
    # and NCCL refuses the guard's all-gather on local ranks >= 1. Still installed before initialize, so its hooks
    # keep running ahead of ZeRO-3's.
    bound: list[torch.device] = []
    install_guard(kwargs["model"], topology, device=lambda: bound[0])
    engine, optimizer, _, scheduler = deepspeed.initialize(training_data=None, mpu=mpu, **kwargs)
    bound.append(engine.device)
    if settings.zero_stage == 3:
        fetch_persistent_at_entry(kwargs["model"])
    if os.environ.get(EVERY_GRADIENT_ENV, "1") != "0":   # after: ZeRO-3's own pre-hooks gather parameters first
        install_every_gradient(kwargs["model"], topology.dp_dsp_group)
    loader = None
    if training_data is not None:
        extra = {} if kwargs["collate_fn"] is None else {"collate_fn": kwargs["collate_fn"]}
        loader = dsp_dataloader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                shuffle=True, drop_last=engine.dataloader_drop_last(), **extra)
    return engine, optimizer, loader, scheduler
