"""A parallelized model given different inputs on the ranks of its DSP group refuses on every rank (issue 25, item 2).

Before, each rank split its own input and the model returned a mix of the ranks' inputs without a
word (an unseeded ``torch.randn`` per rank: 0.51 off; joint-attention text that differs: 0.03 off).
Now ``parallelize``'s forward compares a fingerprint of its arguments (the DeepSpeed guard's:
dtypes, shapes, bytes) across the group before the first collective, on the first call of each
signature, and every call under ``DSP_CHECK=1``; the error names the argument and which ranks
hold alike values. Two ranks, tiny Wan and CogVideoX.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402


def _error(fn: Any) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "no error", time.perf_counter() - start


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import dsp_plugin
    from dsp_plugin.checks import set_check_mode
    from dsp_plugin.testing.tiny import tiny_wan
    from tests.test_plan_joint import TEXT, _tiny_cogvideox

    out: dict[str, Any] = {}
    wan = dsp_plugin.parallelize(tiny_wan(layers=1))
    text = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(0))
    mine = torch.Generator().manual_seed(rank)                 # an unseeded randn: another stream per rank
    out["wan_latents"] = _error(lambda: wan(torch.randn(1, 4, 3, 4, 4, generator=mine), torch.tensor([5]), text))
    cog = dsp_plugin.parallelize(_tiny_cogvideox(rope=False).float())
    video = torch.randn(1, 3, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    words = torch.randn(1, TEXT, 16, generator=torch.Generator().manual_seed(rank))
    out["cogvideox_text"] = _error(lambda: cog(video, words, torch.tensor([5])))
    # alike inputs pass; under DSP_CHECK=1 a rank whose input changes later is caught on that call too
    same = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(9))
    out["alike"] = _error(lambda: wan(same, torch.tensor([5]), text))
    # a signature agreed before is recognized from the call's own arguments; a new one (5 frames) is checked
    out["new_shape"] = _error(lambda: wan(torch.randn(1, 4, 5, 4, 4, generator=mine), torch.tensor([5]), text))
    set_check_mode("always")
    try:
        out["later_call"] = _error(lambda: wan(same + rank, torch.tensor([5]), text))
    finally:
        set_check_mode(None)
    return out


def test_inputs_that_differ_across_the_group_raise_on_every_rank() -> None:
    results = run_distributed(_worker, 2, timeout=300)
    for rank, d in enumerate(results):
        for key, (message, seconds) in d.items():
            print(f"rank {rank} {key} ({seconds:.2f} s): {message}")
        assert d["alike"][0] == "no error", d["alike"]
        for key, argument in (("wan_latents", "hidden_states"), ("cogvideox_text", "encoder_hidden_states"),
                              ("new_shape", "hidden_states"), ("later_call", "hidden_states")):
            message = d[key][0]
            assert message.startswith("InputMismatch: parallelize("), (rank, key, message)
            assert f"the inputs differ across the 2 ranks of group [0, 1]: {argument} (alike on ranks [0] | [1])" \
                in message, (rank, key, message)
            assert "sharded_io" in message and "dsp_dataloader" in message, message
