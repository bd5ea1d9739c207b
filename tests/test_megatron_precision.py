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
#: max |a - b| / max |fp32|, over outputs and each parameter gradient
DSP_VS_SINGLE_BF16 = 3e-2   # same bf16 arithmetic, other reduction order: a few bf16 ulps (2^-8); measured 1.5e-2
BF16_VS_FP32 = 5e-2
FP16_VS_FP32 = 1e-2


@pytest.fixture(scope="module")
def results() -> dict[tuple[int, str], dict]:
    per_rank = run_distributed(run_precision, 2, CASES, timeout=300)
    return {case: per_rank[0][i] for i, case in enumerate(CASES)}


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
