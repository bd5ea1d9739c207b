"""diffusers video transformers: built with ``from_config`` from the published config, fed as their pipelines feed them.

One training step of a text-to-video diffusion transformer, per model class: the noisy latents
(``[B, C, F, H, W]``; CogVideoX ``[B, F, C, H, W]``), a timestep per sample, the text encoder's
output ``[B, L, dim]`` (and CogVideoX's 3-D RoPE tables, ``[F*H*W/4, head_dim]`` each, as its
pipeline passes them) and an MSE loss on the output. The values are random: memory, traffic and
FLOPs depend on shapes only. The parameters are created in ``dtype`` (bf16: DeepSpeed's and
Megatron's bf16 training keep bf16 weights; the fp32 master copy is the optimizer's, counted by
``state``).
"""

from __future__ import annotations

from typing import Any

import torch

from dsp_plugin.dryrun.models import Geometry, ModelSpec

__all__ = ["build", "loss"]


def build(spec: ModelSpec, *, dtype: torch.dtype, recompute: bool) -> torch.nn.Module:
    """``spec.cls.from_config(spec.config)`` with parameters in ``dtype``; full recompute: every block checkpointed."""
    import diffusers

    cls = getattr(diffusers, spec.cls, None)
    if cls is None:
        raise ValueError(f"{spec.name}: diffusers {diffusers.__version__} has no class {spec.cls!r}")
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # Module.to() cannot swap fake parameters: create them in the dtype
    try:
        model = cls.from_config(spec.config)
    finally:
        torch.set_default_dtype(saved)
    if recompute:
        model.enable_gradient_checkpointing()  # torch.utils.checkpoint, non-reentrant, per block
    return model.train()


def _randn(*shape: int, dtype: torch.dtype, generator: torch.Generator | None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


def loss(model: torch.nn.Module, spec: ModelSpec, geometry: Geometry, *, dtype: torch.dtype,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """One forward of ``model`` on a random batch of ``geometry`` and its MSE loss (to call ``backward`` on)."""
    frames, height, width = geometry.latent(spec)
    b, c = geometry.batch, spec.latent_channels
    text = _randn(b, geometry.text_tokens, spec.text_dim, dtype=dtype, generator=generator)
    timestep = torch.randint(0, 1000, (b,), generator=generator)
    if spec.cls == "CogVideoXTransformer3DModel":
        latents = _randn(b, frames, c, height, width, dtype=dtype, generator=generator)
        tokens = frames * (height // spec.patch[1]) * (width // spec.patch[2])
        head_dim = spec.config["attention_head_dim"]
        rope = (torch.randn(tokens, head_dim, generator=generator), torch.randn(tokens, head_dim, generator=generator))
        kwargs: dict[str, Any] = {"hidden_states": latents, "encoder_hidden_states": text, "timestep": timestep,
                                  "image_rotary_emb": rope if spec.config.get("use_rotary_positional_embeddings")
                                  else None}
    else:
        latents = _randn(b, c, frames, height, width, dtype=dtype, generator=generator)
        kwargs = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": text}
    out = model(**kwargs, return_dict=False)[0]
    return out.float().pow(2).mean()
