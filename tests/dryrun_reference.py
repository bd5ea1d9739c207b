"""The real CPU runs the dry run is held against (tests/test_dryrun.py): the same step on gloo, real tensors.

Each worker builds the same model from the same shipped config (``dsp_plugin/dryrun/configs/tiny-*.json``)
with real bf16 tensors, one gloo process per rank, and measures on rank 0 (the rank holding the most
tokens) what the dry run predicts from fake tensors:

- diffusers models (``diffusers_reference``): ``dsp_plugin.parallelize`` inside torch's own
  ``DistributedDataParallel`` over the DP x DSP group (``gradient_as_bucket_view``: the gradients are
  its bf16 buckets, all-reduced in backward: ZeRO stage 0), then an fp32 master copy and
  ``torch.optim.AdamW`` stepping it. Parameters, gradients and optimizer states are the bytes of
  those tensors; activations are ``MemoryTracker``'s peak and ``CommAccounting``'s saved-for-backward
  bytes (``python -m dsp_plugin.bench.memory``'s measure) of a second step (the first one creates
  DDP's buckets and the optimizer's states) run on the module inside DDP, whose gradients accumulate
  into DDP's buckets: DDP's own forward keeps a bucket-sized tensor of its own through the step (a
  communication buffer, not an activation) and broadcasts 2 small tensors, which the dry run does not
  model. Collectives are ``CommAccounting``'s records: the model's of the second step, DDP's gradient
  all-reduce of the first.
- the Megatron STDiT (``megatron_reference``): ``dsp_plugin.dryrun.megatron_family.megatron_step`` with
  ``fake=False`` on the gloo world: Megatron's own DDP, schedule and gradient reduction on real tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def _rows(records: list[Any]) -> dict[str, list[int]]:
    """``{"op/phase/group size": [calls, bytes sent, bytes received]}``."""
    out: dict[str, list[int]] = {}
    for r in records:
        row = out.setdefault(f"{r.op}/{r.phase}/{r.group_size}", [0, 0, 0])
        row[0] += 1
        row[1] += r.bytes_sent
        row[2] += r.bytes_received
    return out


def diffusers_reference(rank: int, world_size: int, model: str, recompute: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.dryrun import diffusers_family
    from dsp_plugin.dryrun.memory import MemoryTracker
    from dsp_plugin.dryrun.step import Setup
    from dsp_plugin.plan import parallelize
    from dsp_plugin.topology import Topology, set_topology

    topology = Topology.build(dsp=world_size)
    set_topology(topology)
    spec, geometry = Setup(model=model, dsp=world_size, recompute=recompute).resolve()
    torch.manual_seed(0)
    net = diffusers_family.build(spec, dtype=torch.bfloat16, recompute=recompute == "full")
    parallelize(net)
    ddp = DistributedDataParallel(net, process_group=topology.dp_dsp_group, gradient_as_bucket_view=True,
                                  broadcast_buffers=False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    master = [p.detach().float().clone() for p in trainable]
    optimizer = torch.optim.AdamW(master, lr=1e-4)
    generator = torch.Generator().manual_seed(1)

    def step(measure: bool) -> dict[str, Any]:
        tracker = MemoryTracker(exclude=[*net.parameters(), *net.buffers(),
                                         *(p.grad for p in trainable if p.grad is not None)], model=net)
        with CommAccounting() as acct, (tracker if measure else _Nothing()):
            loss = diffusers_family.loss(net if measure else ddp, spec, geometry, dtype=torch.bfloat16,
                                         generator=generator)
            saved = acct.saved_activation_bytes
            loss.backward()
            del loss
        for m, p in zip(master, trainable):
            m.grad = p.grad.float()
        optimizer.step()
        for m in master:
            m.grad = None
        return {"records": _rows(acct.records), "peak": tracker.peak, "saved": saved}

    first = step(measure=False)  # DDP's buckets (the gradients) and the optimizer's states now exist
    out = step(measure=True)
    out["records"].update({key: row for key, row in first["records"].items() if key.startswith("all_reduce/")})
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out.update(params=sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad),
               grads=sum(p.grad.numel() * p.grad.element_size() for p in trainable),
               optimizer=sum(t.numel() * t.element_size() for t in [*master, *state]))
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def megatron_reference(rank: int, world_size: int, model: str, recompute: str) -> dict[str, Any]:
    from dsp_plugin.bench.params import H100
    from dsp_plugin.dryrun.megatron_family import megatron_step
    from dsp_plugin.dryrun.step import Setup

    setup = Setup(model=model, dsp=world_size, recompute=recompute)
    spec, geometry = setup.resolve()
    r = megatron_step(setup, spec, geometry, H100, fake=False)
    return {"params": r.params_bytes, "grads": r.grads_bytes, "optimizer": r.optimizer_bytes,
            "peak": r.activations_bytes, "saved": r.saved_bytes,
            "collectives": [(c.op, c.phase, c.group_size, c.count, c.bytes_sent) for c in r.collectives]}


def references(rank: int, world_size: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every ``(model, recompute)`` of ``cases`` on this world, one after the other (one spawn per size)."""
    from dsp_plugin.topology import set_topology

    out = []
    for model, recompute in cases:
        fn = megatron_reference if model.endswith("stdit") else diffusers_reference
        out.append(fn(rank, world_size, model, recompute))
        set_topology(None)
    return out


def deepspeed_reference(rank: int, world_size: int, model: str, stages: list[int]) -> list[dict[str, int]]:
    """What a real DeepSpeed engine (bf16, ZeRO over DP x DSP, torch AdamW) holds in one step, per stage of
    ``stages`` (one engine after the other), in bytes, by the dry run's categories:

    - ``params``: ZeRO-1/2's flat bf16 buffer, or ZeRO-3's partitions plus the parameters it keeps whole;
    - ``optimizer``: the fp32 master partition and every tensor of the optimizer's state;
    - ``grads``: the most gradient bytes held at once outside the reduce bucket (storages counted once), looked at
      when a bucket is reduced and after the backward: every parameter's ``grad`` before ZeRO-1 reduces them, the
      partition ZeRO-2 and 3 keep;
    - ``buffers``: the reduce bucket at its largest (ZeRO-1/2 allocate it per backward), plus the parameters
      ZeRO-3 holds gathered beyond those it keeps whole, seen at every module's forward;
    - ``step_transient``: the fp32 gradient partition the optimizer steps with, seen when it steps.
    """
    import logging
    import os

    from deepspeed.utils import logger

    from dsp_plugin.topology import set_topology

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    logger.setLevel(logging.WARNING)
    out = []
    for stage in stages:
        out.append(_deepspeed_step(world_size, model, stage))
        set_topology(None)
    return out


def _storages(tensors: Any) -> dict[int, int]:
    """{storage address: bytes} of the tensors (views of one storage counted once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _deepspeed_step(world_size: int, model: str, stage: int) -> dict[str, int]:
    from dsp_plugin.deepspeed import initialize
    from dsp_plugin.dryrun import diffusers_family
    from dsp_plugin.dryrun.step import Setup
    from dsp_plugin.plan import parallelize

    spec, geometry = Setup(model=model, dsp=world_size).resolve()
    torch.manual_seed(0)
    net = parallelize(diffusers_family.build(spec, dtype=torch.bfloat16, recompute=False))
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_mode": "dsp",
              "sequence_parallel_size": world_size, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "steps_per_print": 10**9}
    engine, optimizer, _, _ = initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4),
                                         config=config)
    params = list(net.parameters())
    seen = {"grads": 0, "buffers": 0, "step_transient": 0}

    def gradients() -> Any:
        yield from (p.grad for p in params)
        for held in (getattr(optimizer, "averaged_gradients", None) or {}).values():
            yield from (held if isinstance(held, list) else [held])
        yield getattr(optimizer, "grads_in_partition", None)
        yield getattr(optimizer, "grad_partitions_flat_buffer", None)

    def look() -> None:
        buckets = _storages(t for b in optimizer.ipg_buckets.values()
                            for t in (b.buffer if isinstance(b.buffer, list) else [b.buffer]))
        grads = {k: v for k, v in _storages(gradients()).items() if k not in buckets}
        gathered = sum(p.ds_numel * p.element_size() for p in params
                       if stage == 3 and not p.ds_persist and p.data.numel() > 0)
        seen["grads"] = max(seen["grads"], sum(grads.values()))
        seen["buffers"] = max(seen["buffers"], sum(buckets.values()) + gathered)

    def watched(fn: Any, before: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            before()
            return fn(*args, **kwargs)
        return call

    reduce = "reduce_ipg_grads" if stage < 3 else "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
    setattr(optimizer, reduce, watched(getattr(optimizer, reduce), look))
    masters = (optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups)
    inner = optimizer.optimizer

    def stepping() -> None:
        seen["step_transient"] = sum(_storages(m.grad for m in masters).values())

    inner.step = watched(inner.step, stepping)
    hooks = [m.register_forward_pre_hook(lambda *_: look()) for m in net.modules()]  # after DeepSpeed's fetch
    loss = diffusers_family.loss(engine, spec, geometry, dtype=torch.bfloat16,
                                 generator=torch.Generator().manual_seed(1))
    engine.backward(loss)
    look()
    engine.step()
    for hook in hooks:
        hook.remove()

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    state = nbytes(t for s in inner.state.values() for t in s.values())
    if stage == 3:
        persistent = [p for p in params if getattr(p, "ds_persist", False)]
        held = nbytes(optimizer.fp16_partitioned_groups_flat) + nbytes(p.data for p in persistent)
        master = nbytes(optimizer.fp32_partitioned_groups_flat)
    else:
        held = nbytes(optimizer.bit16_groups_flat)
        master = nbytes(optimizer.single_partition_of_fp32_groups)
    return {"params": held, "optimizer": master + state, **seen}
