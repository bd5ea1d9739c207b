"""Measured figures that replace the scale model's assumed ones, read from a JSON file.

The GPU issue measures the layer's achieved TFLOP/s and the pack/unpack copy
rate; a cluster run can add its all-to-all bandwidths. Any subset may be given:

    {"layer_tflops": 420.0,          # achieved TFLOP/s per GPU of one STDiT layer (fwd + bwd)
     "pack_unpack_gbps": 1200.0,     # GB/s of tensor bytes one pack or unpack copies
     "nvlink_gbps": 340.0,           # all-to-all GB/s per GPU inside a node
     "ib_gbps": 45.0,                # all-to-all GB/s per GPU across nodes
     "source": "H100 run of 2026-11-20"}

The file is ``--calibration PATH``, else ``$DSP_BENCH_CALIBRATION``, else
``bench_calibration.json`` in the working directory when present. Unknown keys
and non-positive numbers are refused with the key named, so a typo cannot
silently leave an assumption in place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from dsp_plugin.bench.params import H100, Hardware

DEFAULT_FILE = "bench_calibration.json"
ENV = "DSP_BENCH_CALIBRATION"

#: JSON key -> (Hardware field, factor from the JSON unit to the field's unit, what it replaces)
KEYS = {
    "layer_tflops": ("utilization", 1e12 / H100.peak_flops, "peak 989.4 TFLOPS x assumed utilization 0.45"),
    "pack_unpack_gbps": ("copy_bytes_per_s", 1e9, "assumed 80% of the 3.35 TB/s HBM3 datasheet rate"),
    "nvlink_gbps": ("nvlink_bytes_per_s", 1e9, "assumed 350 GB/s all-to-all (78% of NVLink 4's 450 GB/s)"),
    "ib_gbps": ("ib_bytes_per_s", 1e9, "assumed 50 GB/s (NDR 400 Gb/s datasheet)"),
}


def find(path: Path | str | None = None) -> Path | None:
    """The calibration file to use, or None: explicit path, then the env variable, then the default name."""
    if path is not None:
        return Path(path)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    default = Path(DEFAULT_FILE)
    return default if default.is_file() else None


def load(path: Path | str | None = None, base: Hardware = H100) -> tuple[Hardware, list[tuple[str, str, str]]]:
    """Hardware with the measured numbers applied, and (quantity, value, measured|assumed + source) rows."""
    file = find(path)
    data: dict[str, object] = {}
    if file is not None:
        if not file.is_file():
            raise FileNotFoundError(f"calibration file {file} does not exist")
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"calibration file {file}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(KEYS) - {"source"})
    if unknown:
        raise ValueError(f"calibration file {file}: unknown keys {unknown}; expected some of {sorted(KEYS)}")
    source = str(data.get("source", file))
    changes: dict[str, float] = {}
    rows = []
    for key, (field, factor, assumed) in KEYS.items():
        if key in data:
            value = data[key]
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"calibration file {file}: {key}={value!r}; expected a positive number")
            changes[field] = float(value) * factor
            rows.append((key, f"{value}", f"MEASURED ({source})"))
        else:
            current = getattr(base, field) / factor
            rows.append((key, f"{current:.4g}", f"ASSUMED: {assumed}"))
    return dataclasses.replace(base, **changes), rows
