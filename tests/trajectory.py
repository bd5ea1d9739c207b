"""Final weights of two long Adam runs that differ only in summation order: what fp32 rounding explains.

A parameter whose gradient is zero in exact arithmetic (a key's bias: softmax ignores a constant added to
all of a query's scores) receives only rounding noise as its gradient: in the one-process run the square
root of Adam's second moment there is below 1e-9, against 1e-4..1e-2 elsewhere. Adam's step
``m / (sqrt(v) + eps)`` turns that noise into steps of a sizeable fraction of the learning rate whose sign
depends on the order the gradient was summed in, so two correct runs (DSP and one process) drift apart
there, by at most the sum of the learning rates; they do not change the loss (the model ignores those
elements). ``weight_differences`` compares those elements against that bound and every other one tightly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NOISE = 1e-9     # sqrt(Adam's second moment) below this: the gradient is rounding noise


def _np(x: Any) -> np.ndarray:
    return x.detach().float().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float32)


def weight_differences(a: dict[str, Any], b: dict[str, Any], second_moment: dict[str, Any],
                       ) -> tuple[float, float, list[str]]:
    """(largest difference where the gradient is real, largest where it is noise, the tensors holding noise)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    real, noise, where = 0.0, 0.0, []
    for key, value in a.items():
        diff = np.abs(_np(value) - _np(b[key]))
        quiet = np.sqrt(_np(second_moment[key]).reshape(diff.shape)) < NOISE
        real = max(real, float(diff[~quiet].max(initial=0.0)))
        if quiet.any():
            noise = max(noise, float(diff[quiet].max()))
            where.append(f"{key} ({int(quiet.sum())} of {quiet.size})")
    return real, noise, where
