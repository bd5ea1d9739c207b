"""diffusers' own Ulysses context parallelism on gloo ranks and the CPU, with nothing in diffusers patched.

``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` stops
on a host without an accelerator: ``ModelMixin._resolve_parallel_config``
(diffusers 0.42.1, models/modeling_utils.py:1719) computes the rank's device as
``rank % torch.accelerator.device_count()``, a modulo by zero. That device is
only recorded on the config (``ParallelConfig.setup``); nothing on the context
parallel path reads it. So :func:`enable_ulysses` first calls
``enable_parallelism`` itself, with a CPU ``DeviceMesh`` built here (the config's
``mesh`` field); where that raises ``ZeroDivisionError`` it carries out the rest
of ``enable_parallelism``'s body with diffusers' own functions, in its order:
``ParallelConfig.setup(rank, world, cpu, mesh=mesh)``, the check that the
attention backend supports context parallelism, ``processor._parallel_config``
on every attention processor, ``model._parallel_config``, and
``hooks.context_parallel.apply_context_parallel(model, cp_config, model._cp_plan)``.

The data path that then runs is diffusers' own: its split and gather hooks
(``EquipartitionSharder``: ``tensor.chunk`` of the flat token sequence;
``funcol.all_gather_tensor`` after ``proj_out``) and
``attention_dispatch.TemplatedUlyssesAttention``, which permutes q, k and v into
``[N, S/N, B, H/N, Dh]`` with ``.contiguous()`` copies, sends each with its own
``funcol.all_to_all_single`` (three per attention), permutes them back (three
more copies), runs the attention, and sends the output with a fourth
all-to-all between two more copies.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WHY", "account", "enable_ulysses", "prepare_rank", "refusal"]

#: one sentence for the bench's output
WHY = ("diffusers' `enable_parallelism` stops without an accelerator (`rank % torch.accelerator.device_count()`, "
       "modeling_utils.py:1719: modulo by zero); the bench runs the rest of its body with diffusers' own "
       "`ParallelConfig.setup` (CPU DeviceMesh), `processor._parallel_config` and `apply_context_parallel(model, "
       "cfg, model._cp_plan)`, so the hooks, the split, `TemplatedUlyssesAttention` (q, k, v: one all-to-all each, "
       "the output a fourth, `.contiguous()` copies around each) and the gather are diffusers' own code, unpatched")


def refusal(heads: int, tokens: int, n: int) -> str | None:
    """Why diffusers' plain Ulysses cannot run this shape on ``n`` ranks, or None.

    ``TemplatedUlyssesAttention`` reshapes the heads into ``n`` equal groups, and
    ``all_to_all_single`` without split sizes needs every rank's chunk of the
    flat sequence to be the same length (``ulysses_anything`` lifts both but has
    no backward; it is not what ``ulysses_degree=N`` runs).
    """
    if heads % n:
        return f"cannot run: {heads} heads on {n} ranks (needs H % N == 0)"
    if tokens % n:
        return f"cannot run: {tokens} tokens on {n} ranks (needs tokens % N == 0)"
    return None


def enable_ulysses(model: Any, n: int, plan: dict[str, Any] | None = None) -> str:
    """Turn on diffusers' Ulysses (``ulysses_degree=n``) over the whole world, on the CPU; say how it was done.
    ``plan``: a context-parallel plan in place of the model's ``_cp_plan`` (``enable_parallelism(cp_plan=...)``)."""
    import torch.distributed as dist
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from diffusers.models.attention_processor import Attention
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ulysses_degree=n)
    cp.mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    try:
        model.enable_parallelism(config=cp, cp_plan=plan)
        return "enable_parallelism"
    except ZeroDivisionError:  # no accelerator: the device line only; nothing was recorded on the model yet
        pass
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=cp.mesh)
    processors = [m.processor for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))
                  and getattr(m, "processor", None) is not None and hasattr(m.processor, "_parallel_config")]
    for processor in processors:
        backend = getattr(processor, "_attention_backend", None)
        name = AttentionBackendName(backend) if backend else _AttentionBackendRegistry.get_active_backend()[0]
        if not _AttentionBackendRegistry._is_context_parallel_available(name):
            raise ValueError(f"attention backend {name.value!r} of {type(processor).__name__} does not support "
                             "diffusers' context parallelism")
        processor._parallel_config = config
    model._parallel_config = config
    apply_context_parallel(model, cp, plan if plan is not None else model._cp_plan)
    return "enable_parallelism's body (no accelerator)"


def prepare_rank() -> None:
    """A bench rank's setup before it runs a model both ways: third-party notices out of the tables, the whole world
    the DSP group (``group=None`` refuses without one)."""
    import warnings

    from diffusers.utils import logging as diffusers_logging

    from dsp_plugin.log import quiet_third_party
    from dsp_plugin.topology import Topology, set_topology

    quiet_third_party()
    diffusers_logging.set_verbosity_error()  # "experimental feature"; Wan 2.1's 1-D timestep is left unsplit
    warnings.filterwarnings("ignore", "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated",
                            FutureWarning)   # diffusers' gather hook, once per rank
    set_topology(Topology.world())


def account(forward: Any, expected: list[torch.Tensor]) -> dict[str, Any]:
    """One ``forward()`` (a list of output tensors) under ``no_grad``, its collectives on this rank
    (``CommAccounting``: count and bytes sent per op) and the max |difference| from ``expected``, output by output."""
    from dsp_plugin.accounting import CommAccounting

    with torch.no_grad(), CommAccounting(activations=False) as acct:
        outs = forward()
    ops = sorted({r.op for r in acct.records})
    return {"max_diff": max((o - e).abs().max().item() for o, e in zip(outs, expected, strict=True)),
            "all_to_all": acct.count("all_to_all"), "a2a_bytes": acct.bytes_sent("all_to_all"),
            "all_gather": acct.count("all_gather"), "gather_bytes": acct.bytes_sent("all_gather"),
            "other": acct.count() - acct.count("all_to_all") - acct.count("all_gather"),
            "ops": {op: (acct.count(op), acct.bytes_sent(op)) for op in ops}}
