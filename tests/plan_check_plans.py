"""Plans for ``tests/test_plan_check.py``: the checker run on a good plan and on a wrong one."""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.builtin import LATTE_PLAN
from dsp_plugin.plan.spec import Block

# Latte's temporal blocks said to attend the patches (S): they run after a switch to the frames (T), each rank
# attending only its own frames. Runs without an error and is wrong.
WRONG_AXIS_LATTE_PLAN: dict[str, Any] = {
    **LATTE_PLAN,
    "temporal_transformer_blocks.*": Block("(B S) T D", attends="S", then="T", out_shard="T",
                                           follow={"timestep": "(B S)"}),
}
