"""Worker for ``tests/test_megatron_example.py``: run the "Your own model" block of docs/megatron.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "megatron.md"


def example_source() -> str:
    """The python block after ``<!-- example: own-model -->`` in docs/megatron.md."""
    match = re.search(r"<!-- example: own-model -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    if match is None:
        raise AssertionError(f"{DOC}: no python block after '<!-- example: own-model -->'")
    return match.group(1)


def run_example(rank: int, world_size: int, dsp_sizes: list[int]) -> list[dict[str, Any]]:
    """Execute the example at each DSP size; adaLN weights are drawn non-zero between building and running
    (adaLN-Zero would make every gated branch vanish and the comparison trivial)."""
    import torch
    from megatron.core import parallel_state as ps

    from dsp_plugin.comm import sharded_calls
    from dsp_plugin.megatron.cpu import install_cuda_shim
    from dsp_plugin.megatron.groups import initialize_dsp_model_parallel
    from dsp_plugin.topology import set_topology

    install_cuda_shim()
    source = example_source()
    build, run = source.split("\nvideo = ", 1)
    out = []
    for dsp in dsp_sizes:
        initialize_dsp_model_parallel(dsp=dsp, timeout_minutes=2)
        try:
            torch.manual_seed(0)
            scope: dict[str, Any] = {}
            exec(compile(build, str(DOC), "exec"), scope)  # noqa: S102 - the documented example itself
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for layer in scope["block"].layers:
                    layer.adaln_modulation.weight.copy_(0.1 * torch.randn(layer.adaln_modulation.weight.shape,
                                                                          generator=gen))
            torch.manual_seed(2)
            calls = sharded_calls()
            exec(compile("video = " + run, str(DOC), "exec"), scope)  # noqa: S102
            calls = sharded_calls() - calls
            rope_error = ""
            try:
                scope["block"](hidden_states=scope["split_video_tokens"](scope["video"], scope["config"]),
                               attention_mask=scope["timestep_embedding"], context=scope["text"],
                               rotary_pos_emb=torch.zeros(6, 1, 1, 8))
            except ValueError as exc:  # a rotary table, but the config does not say RoPE
                rope_error = str(exc)
            out.append({"out": scope["out"].detach().numpy().copy(),
                        "video_grad": scope["video"].grad.numpy().copy(), "rope_error": rope_error,
                        "sharded_calls": calls})
        finally:
            ps.destroy_model_parallel()
            set_topology(None)
    return out
