"""``examples/train_wan_fsdp2.py`` trains diffusers' Wan under FSDP2 + DSP, saves with DCP and resumes in another
layout.

The example's own ``main`` with the docs' arguments, on 4 gloo ranks of the test pool (``main`` trains in a
process group that exists; under torchrun it starts its own): 3 steps over dp_shard 2 x dsp 2 (bf16, the model's
own activation checkpointing), saving after steps 2 and 3; then a run that loads the step-2 checkpoint into
another layout, HSDP (dp_replicate 2 x dsp 2: DCP reshards), with ``--compile`` (``aot_eager``: no C++ build),
and takes step 3. Its loss equals the first run's step 3 bitwise: the weights, the AdamW state and the data
position came back, and the compiled layers compute what the eager ones did. Rank 0's log lines are checked too.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_wan_fsdp2", ROOT / "examples" / "train_wan_fsdp2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _straight_then_resumed(rank: int, world: int, save: str) -> dict[str, Any]:
    example = _example()
    lines = _Lines()
    logging.getLogger("dsp_plugin").addHandler(lines)
    try:
        straight = example.main(["--dsp", "2", "--steps", "3", "--save-dir", save, "--save-every", "2"])
        first = list(lines.lines)
        lines.lines.clear()
        resumed = example.main(["--dsp", "2", "--steps", "3", "--load-dir", f"{save}/step2", "--dp-replicate", "2",
                                "--compile", "--compile-backend", "aot_eager"])
    finally:
        logging.getLogger("dsp_plugin").removeHandler(lines)
    return {"straight": straight, "resumed": resumed, "first_log": "\n".join(first), "log": "\n".join(lines.lines)}


@pytest.mark.slow
def test_example_trains_saves_and_resumes_in_another_layout(tmp_path: Path) -> None:
    out = run_distributed(_straight_then_resumed, 4, str(tmp_path / "ckpt"))[0]
    log = out["first_log"]
    assert "'dp_shard': 2, 'dsp': 2" in log and "gradient divide factor 2" in log, log
    assert "DSP: tp(1) x dsp(2) x dp(2)" in log and "all-to-alls forward" in log, log     # the traffic line
    assert "step 3 loss" in log and "samples/s" in log and "saved" in log, log
    log = out["log"]
    assert "'dp_replicate': 2, 'dp_shard': 1" in log and "compile on" in log and "at step 3" in log, log
    straight, resumed = out["straight"], out["resumed"]
    print(f"FSDP2 bf16, dp_shard 2 x DSP 2: {straight}; resumed from step 2 as HSDP 2 x DSP 2, compiled: {resumed}")
    assert list(resumed) == [3]
    assert resumed[3] == straight[3], (resumed, straight)
