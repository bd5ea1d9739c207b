"""One training step of the real-size model on fake tensors, as rank 0 of a fake world: memory, traffic, FLOPs.

    result = dry_run(Setup(model="wan2.1-14b", frames=81, height=720, width=1280, dsp=8, zero=3,
                           recompute="full"))

The model is built from its published config under ``FakeTensorMode`` (no memory is
allocated), made DSP-parallel by ``dsp_plugin.parallelize`` (its built-in plan) on the DSP
group of a ``fake`` process group, and runs forward and backward in bf16 once, inside
``CommAccounting`` (the collectives the plan issues, counted at the dispatcher, with their
bytes and groups) and ``MemoryTracker`` (the live bytes of activations and temporaries, their
peak and the module holding it, and the FLOPs by torch's formulas). Each parameter gradient is
dropped as soon as autograd has it, as ZeRO and Megatron's DDP hand it to their buffers: the
framework's own gradient storage, parameters and optimizer states come from ``state`` (DeepSpeed)
or from Megatron's own buffers (``megatron_family``).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from dsp_plugin.bench.params import H100, Hardware
from dsp_plugin.dryrun.estimate import estimate
from dsp_plugin.dryrun.models import Geometry, ModelSpec
from dsp_plugin.dryrun.result import DryRun, Setup, by_block, group_names, module_name
from dsp_plugin.dryrun.state import FrameworkState

__all__ = ["DryRun", "Setup", "dry_run", "sweep"]


def dry_run(setup: Setup, hw: Hardware = H100) -> DryRun:
    """Run ``setup`` once on fake tensors (see the module docstring); the step time is priced on ``hw``."""
    spec, geometry = setup.resolve()
    if spec.family == "megatron":
        from dsp_plugin.dryrun.megatron_family import dry_run_megatron

        return dry_run_megatron(setup, spec, geometry, hw)
    return _dry_run_diffusers(setup, spec, geometry, hw)


def _dry_run_diffusers(setup: Setup, spec: ModelSpec, geometry: Geometry, hw: Hardware) -> DryRun:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsp_plugin.accounting import CommAccounting
    from dsp_plugin.dryrun import diffusers_family
    from dsp_plugin.dryrun.memory import MemoryTracker
    from dsp_plugin.dryrun.state import PERSISTENCE_THRESHOLD, deepspeed_state
    from dsp_plugin.fake_world import fake_world
    from dsp_plugin.plan import parallelize

    start = time.perf_counter()
    dtype = torch.bfloat16 if setup.dtype == "bf16" else torch.float32
    with fake_world(setup.world, dsp=setup.dsp) as topology, FakeTensorMode():
        model = diffusers_family.build(spec, dtype=dtype, recompute=setup.recompute == "full")
        trainable = [p for p in model.parameters() if p.requires_grad]
        largest = max(sum(p.numel() for p in m.parameters(recurse=False) if p.numel() > PERSISTENCE_THRESHOLD)
                      for m in model.modules())  # ZeRO-3 gathers a module's parameters it does not keep whole
        if setup.dsp > 1:
            parallelize(model)  # the built-in plan, on the topology's DSP group
        for p in trainable:  # ZeRO / DDP take each gradient into their own buffers as it is produced
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        tracker = MemoryTracker(exclude=[*model.parameters(), *model.buffers()], model=model)
        with CommAccounting() as acct, tracker:
            loss = diffusers_family.loss(model, spec, geometry, dtype=dtype)
            saved = acct.saved_activation_bytes  # at the end of the forward
            loss.backward()
            del loss
        collectives = by_block(acct.records, tracker.collective_sites, group_names(topology))
    state: FrameworkState = deepspeed_state([p.numel() for p in trainable], zero=setup.zero,
                                            group_size=setup.dp * setup.dsp, largest_module=largest,
                                            recompute=setup.recompute == "full", sequence_parallel=setup.dsp > 1)
    collectives += state.collectives
    tf, th, tw = geometry.tokens(spec)
    total_flops = float(tracker.flops)
    return DryRun(setup=setup, geometry=geometry.describe(spec), tokens=tf * th * tw * geometry.batch,
                  parameters=sum(p.numel() for p in trainable), params_bytes=state.params,
                  grads_bytes=state.grads, optimizer_bytes=state.optimizer, activations_bytes=tracker.peak,
                  buffers_bytes=state.buffers, step_transient_bytes=state.step_transient, saved_bytes=saved,
                  peak_module=module_name(tracker.peak_module),
                  peak_phase=tracker.peak_phase, flops=total_flops,
                  collectives=collectives,
                  estimate=estimate(total_flops, collectives, tp=setup.tp, world=setup.world, hw=hw),
                  framework=f"DeepSpeed {state.describe}", seconds=time.perf_counter() - start)


def sweep(setup: Setup, dsp_sizes: list[int], hw: Hardware = H100) -> list[DryRun]:
    """``dry_run`` at each DSP size (DP unchanged)."""
    return [dry_run(replace(setup, dsp=n), hw) for n in dsp_sizes]
