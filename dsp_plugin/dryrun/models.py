"""The models the dry run knows, as data: published configs, their VAE and text encoder, and the geometry.

Each model is a JSON file in ``configs/`` (shipped with the package; nothing is downloaded):
``family`` (``diffusers``: ``class`` and the published ``config`` for ``from_config``;
``megatron``: Megatron ``flags`` for the paper's STDiT), the latent ``patch`` (t, h, w), the VAE's
compression (``temporal``, ``spatial``, ``causal``: a causal video VAE maps ``1 + k t`` frames to
``1 + k`` latents, an image VAE maps each frame) and latent ``channels``, the text encoder's
``tokens`` and ``dim``, the default ``geometry`` and the ``source`` of the numbers.
``--config PATH`` takes a file of the same form (a user's own model).

``Geometry`` turns what a user states (frames and pixels, text length, batch) into latents and
tokens, and refuses a size the VAE or the patching cannot take, naming the value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["Geometry", "ModelSpec", "available", "load_spec"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str                       # "diffusers" | "megatron"
    cls: str                          # diffusers class name ("" for megatron)
    config: dict[str, Any]            # from_config (diffusers) or {} (megatron)
    flags: tuple[str, ...]            # megatron flags ("" for diffusers)
    patch: tuple[int, int, int]
    vae_temporal: int
    vae_spatial: int
    vae_causal: bool
    latent_channels: int
    text_tokens: int
    text_dim: int
    frames: int
    height: int
    width: int
    source: str


def available() -> list[str]:
    """The names of the shipped configs (``--model``)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__package__).joinpath("configs").iterdir()
                  if p.name.endswith(".json"))


def load_spec(name_or_path: str) -> ModelSpec:
    """A shipped model by name, or a JSON file of the same form by path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        names = available()
        if name_or_path not in names:
            raise ValueError(f"--model {name_or_path!r}: not a shipped config; expected one of {names} or a path "
                             f"to a JSON file of the same form (dsp_plugin/dryrun/configs/)")
        text, name = resources.files(__package__).joinpath("configs", f"{name_or_path}.json").read_text(), name_or_path
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {name_or_path}: not valid JSON ({exc}); expected a file of the form of "
                         f"dsp_plugin/dryrun/configs/*.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model {name_or_path}: a JSON {type(data).__name__}; expected an object of the form of "
                         f"dsp_plugin/dryrun/configs/*.json")
    family = data.get("family")
    if family not in ("diffusers", "megatron"):
        raise ValueError(f"{name}: family={family!r}; expected 'diffusers' or 'megatron'")
    missing = [f"{key!r} ({_WHAT[key]})" for key, fields in _REQUIRED.items()
               if not isinstance(data.get(key), dict if fields else list)]
    if missing:  # every missing key at once, named with what it must hold
        raise ValueError(f"--model {name_or_path}: missing or malformed {', '.join(missing)}; expected the form "
                         f"of dsp_plugin/dryrun/configs/*.json")
    absent = [f"{key}.{f} ({_WHAT[key]})" for key, fields in _REQUIRED.items() for f in fields if f not in data[key]]
    if absent:
        raise ValueError(f"--model {name_or_path}: missing {', '.join(absent)}; expected the form of "
                         f"dsp_plugin/dryrun/configs/*.json")
    vae, textenc, geometry = data["vae"], data["text"], data["geometry"]
    try:
        patch = tuple(int(p) for p in data["patch"])
        if len(patch) != 3 or min(patch) < 1:
            raise ValueError
        spec = ModelSpec(name=name, family=family, cls=data.get("class", ""), config=data.get("config", {}),
                         flags=tuple(data.get("flags", ())), patch=patch,  # type: ignore[arg-type]
                         vae_temporal=int(vae["temporal"]), vae_spatial=int(vae["spatial"]),
                         vae_causal=bool(vae["causal"]), latent_channels=int(vae["channels"]),
                         text_tokens=int(textenc["tokens"]), text_dim=int(textenc["dim"]),
                         frames=int(geometry["frames"]), height=int(geometry["height"]),
                         width=int(geometry["width"]), source=str(data.get("source", "")))
        if min(spec.vae_temporal, spec.vae_spatial, spec.latent_channels, spec.text_tokens, spec.text_dim,
               spec.frames, spec.height, spec.width) < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"--model {name_or_path}: patch={data['patch']!r}, vae={vae!r}, text={textenc!r}, "
                         f"geometry={geometry!r}; expected positive integers (patch: three; vae.causal: true or "
                         f"false)") from None
    return spec


#: the keys a model file must hold (beside ``family``), with their fields and what they mean
_REQUIRED: dict[str, tuple[str, ...]] = {"patch": (), "vae": ("temporal", "spatial", "causal", "channels"),
                                         "text": ("tokens", "dim"), "geometry": ("frames", "height", "width")}
_WHAT = {"patch": "the latent patch [t, h, w]",
         "vae": "the VAE's compression: temporal, spatial, causal, and its latent channels",
         "text": "the text encoder's tokens and dim", "geometry": "the default frames, height, width"}


@dataclass(frozen=True)
class Geometry:
    """One training sample as a user states it, and what the VAE and the patching make of it."""

    frames: int
    height: int
    width: int
    text_tokens: int
    batch: int = 1

    def latent(self, spec: ModelSpec) -> tuple[int, int, int]:
        """Latent (frames, height, width), or ValueError naming the size the VAE cannot take."""
        t, s = spec.vae_temporal, spec.vae_spatial
        pt, ph, pw = spec.patch
        if spec.vae_causal and (self.frames - 1) % t:
            raise ValueError(f"--frames {self.frames}: {spec.name}'s VAE takes 1 + {t}k frames "
                             f"(..., {1 + t * ((self.frames - 1) // t)}, {1 + t * ((self.frames - 1) // t + 1)}, ...)")
        if not spec.vae_causal and self.frames % t:
            raise ValueError(f"--frames {self.frames}: {spec.name}'s VAE takes a multiple of {t} frames")
        frames = (self.frames - 1) // t + 1 if spec.vae_causal else self.frames // t
        for what, pixels, patch in (("height", self.height, ph), ("width", self.width, pw)):
            if pixels <= 0 or pixels % (s * patch):
                raise ValueError(f"--{what} {pixels}: {spec.name} needs a positive multiple of {s * patch} pixels "
                                 f"(VAE {s}x, patch {patch})")
        if frames % pt:
            raise ValueError(f"--frames {self.frames}: {frames} latent frames do not divide by the temporal patch {pt}")
        return frames, self.height // s, self.width // s

    def tokens(self, spec: ModelSpec) -> tuple[int, int, int]:
        """Tokens per sample along (frames, rows, columns) after the patching."""
        frames, height, width = self.latent(spec)
        pt, ph, pw = spec.patch
        return frames // pt, height // ph, width // pw

    def describe(self, spec: ModelSpec) -> str:
        frames, height, width = self.latent(spec)
        tf, th, tw = self.tokens(spec)
        return (f"{self.frames} frames of {self.height}x{self.width} -> latents {spec.latent_channels}x{frames}x"
                f"{height}x{width} -> {tf}x{th}x{tw} = {tf * th * tw:,} tokens per sample, text {self.text_tokens} "
                f"tokens, batch {self.batch}")
