"""``reduce_gradients``: the project's gradient convention for plain torch, and the used-flags agreement.

Each backward of the primitives is the exact adjoint, so a rank's parameter
gradient is the partial sum over the tokens it holds; the full gradient is the
SUM over the DSP group, averaged over data parallelism.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dsp_plugin import checks
from dsp_plugin.comm.agree import _exchange, _exchange_device, exchange_words
from dsp_plugin.comm.collectives import all_reduce_sum
from dsp_plugin.comm.group_resolution import NoTopologyError, no_topology_message

if TYPE_CHECKING:
    from dsp_plugin.topology import Topology

__all__ = ["reduce_gradients"]


def reduce_gradients(parameters: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]], *,
                     topology: Topology | None = None) -> None:
    """Sum gradients over the DSP axis and average them over data parallelism.

    One all_reduce(SUM) of all gradients flattened together over the DP x DSP
    group, then a division by the DP size. After it every rank holds the
    gradient of the single-process run of the whole global batch (when the
    loss is a mean over samples). ``parameters`` may be ``model.parameters()``
    or ``model.named_parameters()`` (names then appear in errors).

    A parameter this rank did not use (``.grad`` is None: a token or a head
    owned by another rank) takes part as zeros, and one flag per parameter
    travels in the same all_reduce, so afterwards every rank has a gradient for
    exactly the parameters some rank used. The parameter lists must match
    across ranks (count, shapes, dtypes): checked like the primitives' calls
    (``dsp_plugin.checks``: the first call of each signature by default), with
    an error naming the first parameter that differs. Without a topology on
    more than one rank this refuses (``NoTopologyError``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    named = [(item if isinstance(item, tuple) else (f"#{i}", item)) for i, item in enumerate(parameters)]
    named = [(name, p) for name, p in named if p.requires_grad or p.grad is not None]
    from dsp_plugin.topology import get_topology

    topology = topology if topology is not None else get_topology()
    if topology is None:
        if dist.get_world_size() == 1:
            return
        raise NoTopologyError(no_topology_message("reduce_gradients"))
    group, dp = topology.dp_dsp_group, topology.dp
    if group is None or dist.get_world_size(group) == 1 or not named:  # a topology without groups: one process
        return
    # first over the DSP group, where a peer still inside a primitive's check would be waiting
    for checked in dict.fromkeys(g for g in (topology.dsp_group, group) if g is not None and
                                 dist.get_world_size(g) > 1):
        _agree_parameter_list(named, checked)
    dtype = _common_dtype([p.grad if p.grad is not None else p for _, p in named])
    device = named[0][1].device
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format))
              .reshape(-1).to(dtype) for _, p in named]
    pieces.append(torch.tensor([float(p.grad is not None) for _, p in named], dtype=dtype, device=device))
    flat = torch.cat(pieces)
    all_reduce_sum(flat, group=group)
    used = flat[-len(named):].tolist()
    if dp > 1:
        flat.div_(dp)
    offset = 0
    for (_, p), anyone in zip(named, used):
        chunk = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if anyone == 0:
            continue                     # no rank used it: it stays without a gradient, as on one process
        if p.grad is None:
            p.grad = chunk.to(p.dtype).clone(memory_format=torch.contiguous_format)
        else:
            p.grad.copy_(chunk)


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _agree_parameter_list(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """The ranks' parameter lists match (count, shapes, dtypes) before the flat all_reduce, else a clear error.

    Exchanged when ``checks`` says so (by default the first time this process
    sees the list); a mismatch is judged from the same table on every rank. The
    row has the primitives' check format, so a peer waiting in a primitive's
    check on the same group meets this one and both raise.
    """
    shapes = [(tuple(p.shape), str(p.dtype)) for _, p in named]
    key = ("reduce_gradients", tuple(dist.get_process_group_ranks(group)), tuple(shapes))
    if not checks.needs_check_for(key):
        return
    n = dist.get_world_size(group)
    device = _exchange_device(named[0][1], group)
    table = exchange_words([checks.PARAMS_MAGIC, len(named), zlib.crc32(repr(shapes).encode())],
                           group=group, device=device)
    if all(row == table[0] for row in table):
        checks.remember(key)
        return
    ranks = dist.get_process_group_ranks(group)
    elsewhere = [r for r, row in zip(ranks, table) if row[0] != checks.PARAMS_MAGIC]
    if elsewhere:
        raise ValueError(f"reduce_gradients: rank(s) {elsewhere} of group {ranks} are inside a DSP primitive "
                         f"while the others reduce gradients: their forward issued more DSP primitives; "
                         f"expected the same model, DSP-aware alike, on every rank")
    counts = [row[1] for row in table]
    if len(set(counts)) > 1:
        raise ValueError(f"reduce_gradients: the ranks of group {ranks} pass different numbers of parameters "
                         f"({', '.join(f'{c} on rank {r}' for r, c in zip(ranks, counts))}); expected the same "
                         f"parameters on every rank (pass model.parameters() of the same model everywhere)")
    sizes = _exchange([p.numel() * 64 + _DTYPE_CODES.get(p.dtype, 63) for _, p in named], device, group, n)
    for i, (name, p) in enumerate(named):
        column = [row[i] for row in sizes]
        if len(set(column)) > 1:
            described = ", ".join(f"{v // 64} elements on rank {r}" for r, v in zip(ranks, column))
            raise ValueError(f"reduce_gradients: parameter {name} differs across group {ranks}: {described} "
                             f"(or another dtype); expected the same parameters on every rank")
    raise ValueError(f"reduce_gradients: the parameter shapes of group {ranks} differ (same sizes, other "
                     f"shapes); expected the same parameters on every rank")


_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
