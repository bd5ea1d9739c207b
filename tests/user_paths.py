"""How users call a public entry, as data: the group styles of the test matrix (issue 25).

One 4-rank spawn per entry family loops over these styles inside it (``GroupStyles``), so
the matrix costs one process start per family, not one per cell. Each style says which
topology is installed and which ``group=`` the entry is given:

=================================  ==============================  ======================  =====
style                              topology installed              ``group=`` passed       N
=================================  ==============================  ======================  =====
``explicit_world_no_topology``     none                            a new group of all 4    4
``explicit_pair_no_topology``      none                            a new group of 2        2
``explicit_pair_under_world``      ``Topology.world()`` (4)        a new group of 2        2
``world_topology``                 ``Topology.world()``            None                    4
``dsp2_dp2_topology``              ``Topology.build(dsp=2)``       None                    2
=================================  ==============================  ======================  =====

The pair styles and DSP=2 x DP=2 make the DSP group a strict subgroup of the world:
code that falls back to the world (``group_size()`` without the group) gives a wrong
answer or a ``NoTopologyError`` there. Each DSP group gets its own batch seed
(``batch_seed``), so a result that mixed two groups would not match its one-process oracle.

The attention-backend axis of the matrix (diffusers' ``set_attention_backend``) is a
parameter of the families that attend (``BACKENDS``): the backends of diffusers 0.42.1 that
run on CPU (``native``, ``_native_math``, ``flex``: forward only, "FlexAttention does not
support backward on CPU") and ``plain``, a backend registered in diffusers' registry that calls
no SDPA (``tests.test_heads_backends.plain_attention``), standing for any kernel the head switch
never saw. A model without the setting (it calls SDPA itself) runs under the first only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BACKENDS", "STYLES", "GroupStyles", "Style", "backward_runs", "sum_over", "use_backend"]

STYLES = ("explicit_world_no_topology", "explicit_pair_no_topology", "explicit_pair_under_world", "world_topology",
          "dsp2_dp2_topology")
#: the diffusers attention backends a family that attends runs under
BACKENDS = ("native", "_native_math", "flex", "plain")


@dataclass
class Style:
    name: str
    group: Any            # what the entry is given as group= (None: the installed topology's)
    dsp_group: Any        # the DSP group the entry must use (for the test's own sums)
    ranks: list[int]      # its global ranks
    batch_seed: int       # the DSP group's own data


class GroupStyles:
    """Every group a style needs, created once on every rank in the same order (``new_group`` requires it)."""

    def __init__(self) -> None:
        from dsp_plugin.topology import Topology, set_topology

        assert dist.get_world_size() == 4, "the matrix runs on 4 ranks"
        self.rank = dist.get_rank()
        self.world = dist.new_group([0, 1, 2, 3])
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.pair, self.pair_ranks = pairs[self.rank // 2], [0, 1] if self.rank < 2 else [2, 3]
        self.dsp2 = Topology.build(dsp=2)
        set_topology(None)

    def enter(self, name: str) -> Style:
        """Install ``name``'s topology (or none) and return what the entry is called with."""
        from dsp_plugin.topology import Topology, set_topology

        pair_seed = 10 + self.rank // 2
        if name == "explicit_world_no_topology":
            set_topology(None)
            return Style(name, self.world, self.world, [0, 1, 2, 3], 10)
        if name == "explicit_pair_no_topology":
            set_topology(None)
            return Style(name, self.pair, self.pair, self.pair_ranks, pair_seed)
        if name == "explicit_pair_under_world":
            set_topology(Topology.world())
            return Style(name, self.pair, self.pair, self.pair_ranks, pair_seed)
        if name == "world_topology":
            set_topology(Topology.world())
            return Style(name, None, dist.group.WORLD, [0, 1, 2, 3], 10)
        if name == "dsp2_dp2_topology":
            set_topology(self.dsp2)
            return Style(name, None, self.dsp2.dsp_group, dist.get_process_group_ranks(self.dsp2.dsp_group),
                         pair_seed)
        raise ValueError(f"unknown group style {name!r}; expected one of {STYLES}")


def sum_over(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over ``group`` (a copy): the one-process gradient under the project's convention."""
    out = tensor.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def use_backend(model: torch.nn.Module, backend: str) -> bool:
    """Set diffusers' attention ``backend`` on ``model``; False: the model has no such setting and ``backend``
    is not the first of ``BACKENDS`` (it would run the same SDPA again: the cell is skipped)."""
    if not hasattr(model, "set_attention_backend"):
        return backend == BACKENDS[0]
    slot = backend
    if backend == "plain":
        from tests.test_heads_backends import PLAIN_SLOT, register_plain

        register_plain()
        slot = PLAIN_SLOT
    model.set_attention_backend(slot)
    return True


def backward_runs(backend: str) -> bool:
    """Whether ``backend`` has a backward on CPU (flex has not)."""
    return backend != "flex"
