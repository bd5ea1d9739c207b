"""Transformer Engine against this torch: it imports, a bf16 ``te.Linear`` runs forward and backward, and FP8 too.

TE's torch extension is compiled against one torch; a TE built for another fails
at import (undefined symbols) or at the first kernel. Not installed: SKIP; installed
and broken: FAIL with the error.

    python scripts/gpu_check/te_import.py
"""

from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu_check.report import finish, skip  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        skip("no CUDA device")
    if importlib.util.find_spec("transformer_engine") is None:
        skip(f"transformer_engine is not installed (torch {torch.__version__})")
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except Exception as exc:  # noqa: BLE001 - an ABI mismatch shows as any error at import
        finish(False, f"transformer_engine {getattr(sys.modules.get('transformer_engine'), '__version__', '?')} "
                      f"does not import against torch {torch.__version__}: {type(exc).__name__}: {exc}")
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().pow(2).mean().backward()
    ok, fp8 = bool(torch.isfinite(x.grad).all()), "FP8 not run (needs sm_89 or newer)"
    if torch.cuda.get_device_capability() >= (8, 9):
        autocast = getattr(te, "fp8_autocast", None) or te.autocast
        with autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID)):
            out = layer(x)
        out.float().pow(2).mean().backward()
        fp8_ok = bool(torch.isfinite(out.float()).all())
        ok, fp8 = ok and fp8_ok, f"FP8 (hybrid) forward+backward {'finite' if fp8_ok else 'NOT finite'}"
    torch.cuda.synchronize()
    finish(ok, f"transformer_engine {transformer_engine.__version__} on torch {torch.__version__} "
               f"({torch.cuda.get_device_name()}): bf16 te.Linear forward+backward finite={ok}; {fp8}")


if __name__ == "__main__":
    main()
