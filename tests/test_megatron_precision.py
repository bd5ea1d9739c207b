"""bf16 and fp16 through megatron-core's ``Float16Module`` on CPU (2 gloo ranks).

``Float16Module`` casts the parameters and every floating input of the first stage
to half precision; the model must keep the timestep (an integer) and its
sinusoidal features in fp32 and cast the features to the weights' dtype, and the
text embedding must follow the weights. Checked: the model runs in bf16 and fp16
(parameters and output dtypes as Megatron sets them), DSP=2 equals DSP=1 within
bf16 rounding, and bf16 stays within a stated distance of fp32. Tolerances are
relative to the largest magnitude of the fp32 tensor (printed with ``-s``).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_compositions import run_precision  # noqa: E402

CASES = [(1, "fp32"), (1, "bf16"), (2, "bf16"), (2, "fp16")]
#: --dsp-comm-dtype fp8 (DSPTransformerConfig.dsp_comm_dtype): the switches of the factorized layers, the head
#: switches of full layers (the mixed pattern), and the switch replay of full recompute, against the same in bf16
FP8_CASES = {"fp8": (2, "bf16", {"comm_dtype": "fp8"}),
             "mixed": (2, "bf16", {"variant": "mixed"}),
             "mixed fp8": (2, "bf16", {"variant": "mixed", "comm_dtype": "fp8"}),
             "fp8 recompute": (2, "bf16", {"comm_dtype": "fp8", "recompute": True})}
#: FP8 payload against the bf16 payload, the largest element difference relative to max |fp32|: e4m3 keeps 3
#: mantissa bits (rounding up to 2^-4 of a chunk's range) per switched element, three switches deep; measured
#: 9.7e-2 output / 8.5e-2 gradients (factorized), 3.5e-2 / 2.4e-2 (mixed: head switches)
FP8_VS_BF16 = 0.15
#: ... and the loss, relative: measured 1.4e-4 (factorized), 3.5e-4 (mixed)
FP8_LOSS_VS_BF16 = 2e-3
#: max |a - b| / max |fp32|, over outputs and each parameter gradient
DSP_VS_SINGLE_BF16 = 3e-2   # same bf16 arithmetic, other reduction order: a few bf16 ulps (2^-8); measured 1.5e-2
BF16_VS_FP32 = 5e-2
FP16_VS_FP32 = 1e-2


@pytest.fixture(scope="module")
def results() -> dict[object, dict]:
    per_rank = run_distributed(run_precision, 2, CASES + list(FP8_CASES.values()), timeout=300)
    return {case: per_rank[0][i] for i, case in enumerate(CASES + list(FP8_CASES))}


def _relative(a: dict, b: dict, scale: dict) -> tuple[float, float]:
    out = np.abs(a["output"] - b["output"]).max() / np.abs(scale["output"]).max()
    grad = max(np.abs(a["grads"][n] - b["grads"][n]).max() / max(np.abs(scale["grads"][n]).max(), 1e-12)
               for n in scale["grads"])
    return float(out), float(grad)


def test_float16_module_runs_in_half_precision(results: dict) -> None:
    assert results[(2, "bf16")]["param_dtype"] == "torch.bfloat16"
    assert results[(2, "fp16")]["param_dtype"] == "torch.float16"
    assert results[(2, "bf16")]["dtype"] == "torch.float32"  # Float16Module upcasts the last stage's output
    for case in CASES:
        assert np.isfinite(results[case]["output"]).all()
        assert all(np.isfinite(g).all() for g in results[case]["grads"].values()), case


def test_dsp2_equals_dsp1_in_bf16(results: dict) -> None:
    out, grad = _relative(results[(2, "bf16")], results[(1, "bf16")], results[(1, "fp32")])
    print(f"\nbf16 DSP=2 vs DSP=1: output {out:.2e}, gradients {grad:.2e} (relative to max |fp32|)")
    assert out < DSP_VS_SINGLE_BF16 and grad < DSP_VS_SINGLE_BF16


def test_half_precision_close_to_fp32(results: dict) -> None:
    for dtype, tolerance in (("bf16", BF16_VS_FP32), ("fp16", FP16_VS_FP32)):
        out, grad = _relative(results[(2, dtype)], results[(1, "fp32")], results[(1, "fp32")])
        loss = abs(results[(2, dtype)]["loss"] - results[(1, "fp32")]["loss"])
        print(f"\n{dtype} DSP=2 vs fp32: output {out:.2e}, gradients {grad:.2e}, |loss diff| {loss:.2e}")
        assert out < tolerance and grad < tolerance, (dtype, out, grad)


def test_fp8_switch_payload_through_megatron_config(results: dict) -> None:
    """``--dsp-comm-dtype fp8``: every all-to-all of the DSP layers (switches; head switches of full layers;
    under full recompute the replayed switch's backward) sends half the bf16 bytes plus a 4-byte scale per
    chunk (one peer at N=2), and the model stays within FP8's rounding of the bf16-payload run."""
    scale = results[(1, "fp32")]
    for fp8, exact in (("fp8", (2, "bf16")), ("mixed fp8", "mixed"), ("fp8 recompute", (2, "bf16"))):
        for phase in ("forward", "backward"):
            sent8, sent16 = results[fp8]["all_to_all"][phase], results[exact]["all_to_all"][phase]
            assert len(sent8) == len(sent16) > 0, (fp8, phase, sent8, sent16)
            # a head switch sends q, k, v in one buffer: one scale per tensor and peer
            scales = [b8 - b16 // 2 for b8, b16 in zip(sent8, sent16)]
            assert all(s in (4, 12) for s in scales), (fp8, phase, sent8, sent16)
        out, grad = _relative(results[fp8], results[exact], scale)
        loss = abs(results[fp8]["loss"] - results[exact]["loss"]) / abs(results[exact]["loss"])
        print(f"\n{fp8} vs bf16 payload: output {out:.2e}, gradients {grad:.2e}, loss {loss:.2e}; all-to-all "
              f"bytes forward {sum(results[fp8]['all_to_all']['forward'])} vs "
              f"{sum(results[exact]['all_to_all']['forward'])}")
        assert 0 < out < FP8_VS_BF16 and 0 < grad < FP8_VS_BF16 and loss < FP8_LOSS_VS_BF16, (fp8, out, grad, loss)
    out, grad = _relative(results["fp8 recompute"], results["fp8"], scale)
    print(f"fp8 with full recompute vs without: output {out:.2e}, gradients {grad:.2e}")
    assert out == 0 and grad == 0     # the replay reuses the forward's switch: the same bytes, the same values
