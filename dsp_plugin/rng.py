"""A process's random generators as plain tensors and ints, to save in a checkpoint and restore on resume.

A resumed run equals the uninterrupted one only if every random draw after the resume (a diffusion step's
timesteps and noise, caption or activation dropout) is the one the uninterrupted run made: the generators
travel with the checkpoint. ``states()`` holds torch's CPU generator, the device's (CUDA), ``numpy.random``'s
global state and ``random``'s, as tensors, lists, ints and floats only, so ``torch.load(weights_only=True)``
reads them back. Used by ``dsp_plugin.deepspeed.checkpoint`` and ``dsp_plugin.launch.train_state``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["restore", "states"]


def states(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generators (``device``: also that CUDA device's)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
                           "numpy": [kind, int(pos), int(has_gauss), float(gauss)],
                           "random": [version, list(internal), gauss_next]}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore(saved: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back what ``states`` returned (the CUDA generator only when both sides have one)."""
    torch.set_rng_state(saved["torch"])
    kind, pos, has_gauss, gauss = saved["numpy"]
    np.random.set_state((kind, saved["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = saved["random"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in saved and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
