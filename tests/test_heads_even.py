"""The head switch on a folded sequence that splits evenly: switched as one axis, equal to one process.

A ``Heads`` call whose sequence folds several axes (Wan's ``(F HW)``, sharded on F) unfolds them to switch on
the sharded axis and folds them back: 8 views per attention. When the sharded axis is the outermost and splits
evenly over the ranks, this rank's tokens are one even block of the folded sequence, so the folded sequence
is switched as one axis (``HeadsCall.switch_*``): the same elements in the same order, none of those views. The
other tests of the head switch use 5 frames (uneven on 2 and 4 ranks: the unfolded path); this one uses 4
(even on 2 and 4). Oracle: the unmodified diffusers model on one process, fp64, forward and backward; Wan
(self-attention through the dispatch) and HunyuanVideo with ``HUNYUAN_VIDEO_FRAMES_PLAN`` (whole frames,
joint text last, a text key-padding mask).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

from tests.distributed import run_distributed  # noqa: E402
from tests.test_heads_backends import _wan  # noqa: E402


def _case(name: str) -> tuple[torch.nn.Module, dict[str, object], dict[str, torch.Tensor], torch.Tensor]:
    """(model, plan or None, inputs, target), fp64, 4 latent frames [B, C, F, H, W]."""
    g = torch.Generator().manual_seed(3)
    latents, target = torch.randn(2, 4, 4, 6, 6, generator=g).double(), torch.randn(2, 4, 4, 6, 6, generator=g)
    if name == "wan":
        inputs = {"hidden_states": latents, "timestep": torch.tensor([3, 700]),
                  "encoder_hidden_states": torch.randn(2, 7, 16, generator=g).double()}
        return _wan(torch.float64), None, inputs, target.double()
    from dsp_plugin.plan.builtin import HUNYUAN_VIDEO_FRAMES_PLAN
    from dsp_plugin.testing.tiny_video import hunyuan_video

    model, inputs = hunyuan_video()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    return model.double(), HUNYUAN_VIDEO_FRAMES_PLAN, inputs | {"hidden_states": latents}, target.double()


def _worker(rank: int, n: int) -> dict[str, float | int]:
    import dsp_plugin
    from dsp_plugin import reduce_gradients
    from dsp_plugin.plan import attention

    folded = [0]
    init = attention.HeadsCall.__init__

    def counting(call: attention.HeadsCall, *args: object, **kwargs: object) -> None:
        init(call, *args, **kwargs)
        folded[0] += len(call.switch_local) == 1 and len(call.local) > 1  # switched as one folded axis

    attention.HeadsCall.__init__ = counting  # type: ignore[method-assign]
    result: dict[str, float | int] = {}
    for name in ("wan", "hunyuan_video"):
        reference, plan, inputs, target = _case(name)
        model = dsp_plugin.parallelize(copy.deepcopy(reference), plan)
        folded[0] = 0
        outs = []
        for m in (reference, model):
            out = m(**inputs, return_dict=False)[0]
            torch.nn.functional.mse_loss(out, target).backward()
            outs.append(out.detach())
        reduce_gradients(model.parameters())
        grads = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
                 if q.grad is not None]
        result[f"{name}/out"] = (outs[1] - outs[0]).abs().max().item()
        result[f"{name}/grads"] = max(grads)
        result[f"{name}/folded"] = folded[0]
    dist.barrier()
    return result


@pytest.mark.parametrize("n", [2, 4])
def test_even_folded_sequence_switches_as_one_axis(n: int) -> None:
    for rank, r in enumerate(run_distributed(_worker, n)):
        print(f"n={n} rank {rank}: {r}")
        for name in ("wan", "hunyuan_video"):
            assert r[f"{name}/out"] < 5e-9 and r[f"{name}/grads"] < 5e-9, (rank, name, r)
            assert r[f"{name}/folded"] > 0, (rank, name, r)  # the one-axis switch ran
