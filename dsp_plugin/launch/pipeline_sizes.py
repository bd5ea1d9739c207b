"""``dsp-sample --model DIR``: the video size checked against the saved pipeline's configs, before any process starts.

A ``save_pretrained`` directory says in its JSON files what sizes its models take, so a size they cannot
take is refused here by name instead of deep inside a model (Wan's RoPE: ``shape '[41, 1, 1, -1]' is
invalid``), and without loading a weight:

- Wan: after the VAE (``scale_factor_temporal``, ``scale_factor_spatial``; the pipeline rounds the frames
  to ``1 + k t``) and the patching, each of the frames, rows and columns of tokens must be at most the
  transformer's ``rope_max_seq_len`` (its RoPE table has that many positions), checked for
  ``transformer_2`` too (Wan 2.2);
- Latte: the frames must be the transformer's ``video_length`` (its temporal position table);
- both: at least one latent frame per DSP rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["check_pipeline_sizes", "latte_video_length", "pipeline_kind"]


def _config(directory: Path, component: str) -> dict[str, Any] | None:
    path = directory / component / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {directory}: {component}/config.json cannot be read ({exc}); expected the "
                         f"JSON that diffusers' save_pretrained writes") from None
    return data if isinstance(data, dict) else None


#: sampled by ``parallelize_pipeline`` (their transformers' built-in plans; the latents whole on every rank)
PLANNED_PIPELINES = ("LTX2Pipeline", "HunyuanVideo15Pipeline", "WanVACEPipeline", "Kandinsky5T2VPipeline")


def pipeline_kind(directory: str | Path) -> str | None:
    """``"wan"``, ``"latte"``, ``"pipeline"`` (one of ``PLANNED_PIPELINES``) or None (another pipeline, or an
    unreadable ``model_index.json``)."""
    try:
        name = json.loads((Path(directory) / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    if name in PLANNED_PIPELINES:
        return "pipeline"
    return {"WanPipeline": "wan", "LattePipeline": "latte"}.get(name)


def saved_without(directory: str | Path) -> list[str]:
    """The components ``save_pretrained`` wrote as ``[null, null]`` (a pipeline built without its text encoder):
    ``from_pretrained`` refuses a missing component that is not optional (LTX-2's ``text_encoder``) unless it is
    passed, so they are passed as ``None``."""
    try:
        index = json.loads((Path(directory) / "model_index.json").read_text())
    except (OSError, ValueError):
        return []
    return [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v == [None, None]]


def latte_video_length(directory: str | Path) -> int | None:
    """A Latte directory's ``video_length`` (the frames its temporal position table holds), or None."""
    length = (_config(Path(directory), "transformer") or {}).get("video_length")
    return length if isinstance(length, int) and length > 0 else None


def check_pipeline_sizes(directory: str | Path, *, frames: int, height: int, width: int, dsp: int,
                         defaults: tuple[str, ...] = ()) -> None:
    """Refuse (``ValueError``, naming each value and the largest it may be) a size the saved pipeline cannot take.

    ``defaults``: the flags the user did not give (named as defaults in the message)."""
    directory = Path(directory)
    kind = pipeline_kind(directory)

    def flag(name: str, value: int) -> str:
        return f"--{name} {value}" + (" (the default for a pipeline directory)" if name in defaults else "")

    multiple = 16 if kind == "wan" else 8   # the pipelines' own check_inputs
    for name, value in (("height", height), ("width", width)):
        if kind in ("wan", "latte") and value % multiple:
            raise ValueError(f"--model {directory}: {flag(name, value)}; a {kind.capitalize()}Pipeline takes a "
                             f"multiple of {multiple} pixels")
    if kind == "latte":
        length = latte_video_length(directory)
        if length is not None and length > 1 and frames != length:
            raise ValueError(f"--model {directory}: {flag('num-frames', frames)}, but its LatteTransformer3DModel "
                             f"has video_length {length} (its temporal position table); expected --num-frames "
                             f"{length}")
        if frames < dsp:
            raise ValueError(f"{flag('num-frames', frames)} gives fewer latent frames than --dsp {dsp}; expected "
                             f"--num-frames >= {dsp}")
        return
    if kind != "wan":
        return
    vae = _config(directory, "vae") or {}
    t, s = int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))
    latent = (frames - 1) // t + 1   # the pipeline rounds num_frames to 1 + k t (down)
    if latent < dsp:
        raise ValueError(f"{flag('num-frames', frames)} gives {latent} latent frames, fewer than --dsp {dsp}; "
                         f"expected --num-frames >= {(dsp - 1) * t + 1}")
    for component in ("transformer", "transformer_2"):
        config = _config(directory, component)
        if config is None or not isinstance(config.get("rope_max_seq_len"), int):
            continue
        limit = config["rope_max_seq_len"]
        pt, ph, pw = config.get("patch_size", (1, 2, 2))
        tokens = {"num-frames": (frames, latent // pt, (limit * pt - 1) * t + 1),
                  "height": (height, height // s // ph, limit * ph * s // 16 * 16),
                  "width": (width, width // s // pw, limit * pw * s // 16 * 16)}
        over = {name: v for name, v in tokens.items() if v[1] > limit}
        if over:
            said = ", ".join(f"{flag(name, value)} gives {count} tokens" for name, (value, count, _) in over.items())
            most = ", ".join(f"--{name} <= {top}" for name, (_, _, top) in over.items())
            raise ValueError(f"--model {directory}: {said} along that axis, more than its {component}'s "
                             f"rope_max_seq_len {limit} (its RoPE table's positions; VAE {t}x in time, {s}x in "
                             f"space, patch {pt}x{ph}x{pw}); expected {most}")
