"""Where the switches go along a chain of blocks that each attend one sequence dim (compiled once, as data).

Among the sequence dims a block does not attend, switch to the one whose next use is furthest away
(Belady's rule). For spatial/temporal blocks that is simply the other dim: one switch per block, two
per layer. With three axes it saves a switch every other block. The reference STDiT's built-in
plan (``dsp_plugin.plan.builtin.stdit_plan``) builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["switch_schedule"]


def switch_schedule(attend_dims: Sequence[int], sequence_dims: Sequence[int],
                    first_shard: int) -> tuple[list[tuple[int, int] | None], int]:
    """For each block, ``(cur, tgt)`` if a switch must precede it, else None; and the final shard dim.

    >>> switch_schedule([2, 1, 2, 1], [1, 2], first_shard=1)
    ([None, (1, 2), (2, 1), (1, 2)], 2)
    """
    if first_shard not in sequence_dims:
        raise ValueError(f"first shard dim {first_shard} is not one of the sequence dims {list(sequence_dims)}")
    for i, a in enumerate(attend_dims):
        if a not in sequence_dims:
            raise ValueError(f"block {i} attends dim {a}, which is not one of the sequence dims "
                             f"{list(sequence_dims)}")
    if len(sequence_dims) < 2:
        raise ValueError(f"DSP needs at least two sequence dims to switch between, got {list(sequence_dims)}")
    schedule: list[tuple[int, int] | None] = []
    cur = first_shard
    for i, a in enumerate(attend_dims):
        if a != cur:
            schedule.append(None)
            continue

        def next_use(d: int, start: int = i + 1) -> int:
            later = [j for j in range(start, len(attend_dims)) if attend_dims[j] == d]
            return later[0] if later else len(attend_dims)

        tgt = max((d for d in sequence_dims if d != a), key=lambda d: (next_use(d), -d))
        schedule.append((cur, tgt))
        cur = tgt
    return schedule, cur
