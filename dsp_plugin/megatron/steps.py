"""What a ``megatron.training`` launch plugs in: dataset, model provider, forward step, loss.

Used by ``launch/pretrain_stdit.py`` (GPU: ``pretrain()``; CPU: ``cpu.py``) and by
the tests, so the tested path is the launched path.

Loss convention (design section 3): the loss function returns the *local* share
of the per-sample MSE, ``sum over local tokens / numel of the micro-batch``, in
Megatron's two-value form ``(loss, {"loss": [value, count]})``. Megatron
multiplies the loss by the context-parallel (= DSP) size before backward and
its DDP divides gradients by DP x CP, so the result is SUM over DSP, MEAN over
DP. The reported ``[value, count]`` pair is summed by ``train_step`` over
micro-batches and DP x CP; with ``count = 1/DSP`` per rank the logged loss is the
mean over DP of the full loss, with no collective of our own.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

from dsp_plugin.comm import split
from dsp_plugin.megatron.layers import layer_spec
from dsp_plugin.megatron.model import STDiTMegatron, VideoShape, shard_dim_after
from dsp_plugin.megatron.weights import init_like_single_process

__all__ = ["SyntheticVideoDataset", "add_model_arguments", "build_model", "forward_step", "loss_func",
           "model_provider", "video_shape_from_args"]


class SyntheticVideoDataset(torch.utils.data.Dataset):
    """Deterministic synthetic video latents: sample ``i`` depends only on ``(seed, i)``.

    Each item: ``latents`` (noisy latent video) and ``target`` (the noise to
    predict), both ``[C, T, H, W]``, and a diffusion ``timestep``. No downloads.
    """

    def __init__(self, video: VideoShape, num_samples: int, *, seed: int = 1234) -> None:
        self.video, self.num_samples, self.seed = video, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        v = self.video
        clean = torch.randn(v.channels, v.frames, v.height, v.width, generator=gen)
        noise = torch.randn(v.channels, v.frames, v.height, v.width, generator=gen)
        timestep = torch.randint(0, 1000, (), generator=gen).float()
        alpha = torch.cos(timestep / 1000 * torch.pi / 2)
        return {"latents": alpha * clean + (1 - alpha**2).sqrt() * noise, "target": noise, "timestep": timestep}


def build_model(config: TransformerConfig, video: VideoShape, *, transformer_impl: str = "local",
                pre_process: bool = True, post_process: bool = True, seed: int | None = None,
                pg_collection: Any = None) -> STDiTMegatron:
    """One pipeline stage; with ``seed``, weights equal the single-process model's (``weights.py``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    model = STDiTMegatron(config, layer_spec(transformer_impl), video,
                          pre_process=pre_process, post_process=post_process)
    model.model_type = ModelType.encoder_or_decoder  # what megatron.training's get_model sets
    # megatron.training's train_step reads the model's groups (mp, pp, dp_cp) from here
    model.pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    if seed is not None:
        init_like_single_process(model, seed=seed, layer_offset=model.layer_offset)
    return model


def loss_func(target: torch.Tensor, num_layers: int, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Local share of the per-sample MSE on this rank's shard (see the module docstring)."""
    batch, channels, frames, height, width = target.shape
    tokens = target.permute(0, 2, 3, 4, 1).reshape(batch, frames, height * width, channels)
    group = ps.get_context_parallel_group()
    local_target = split(tokens, shard_dim_after(num_layers - 1), group=group)  # data: no gradient
    local = (output.float() - local_target.float()).pow(2).sum() / target.numel()
    # Megatron's [sum, count] report: train_step sums it over micro-batches and DP x CP and
    # divides; each DSP rank counts 1/N, so the result is the mean over DP of the full loss
    count = local.new_tensor(1.0 / ps.get_context_parallel_world_size())
    return local, {"loss": torch.stack([local.detach(), count])}


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, partial]:
    """Megatron ``forward_step_func``: every stage reads the batch (cheap, keeps iterators aligned)."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    latents, target = batch["latents"].to(device), batch["target"].to(device)
    output = model(latents, batch["timestep"].to(device))
    return output, partial(loss_func, target, _unwrap(model).config.num_layers)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


# -- megatron.training glue ---------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Latent video geometry of the synthetic data (Megatron has no such options)."""
    group = parser.add_argument_group(title="spatial-temporal model (dsp_plugin)")
    group.add_argument("--latent-channels", type=int, default=4)
    group.add_argument("--num-frames", type=int, default=8, help="latent frames T")
    group.add_argument("--latent-height", type=int, default=4, help="latent patches along H")
    group.add_argument("--latent-width", type=int, default=4, help="latent patches along W")
    group.add_argument("--init-seed", type=int, default=None,
                       help="initialise weights independently of TP/DSP/PP (comparable loss curves)")
    return parser


def video_shape_from_args(args: argparse.Namespace) -> VideoShape:
    return VideoShape(args.latent_channels, args.num_frames, args.latent_height, args.latent_width)


def model_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """Megatron's config from the arguments, with attention kept local (``context_parallel_size=1``)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    # The CP slot of parallel_state holds DSP; the layers must see CP=1 or TE starts ring attention.
    saved = args.context_parallel_size
    args.context_parallel_size = 1
    try:
        config = core_transformer_config_from_args(args)
    finally:
        args.context_parallel_size = saved
    if ps.get_pipeline_model_parallel_world_size() > 1:
        config.variable_seq_lengths = True  # uneven shards: let Megatron exchange p2p shapes
    return config


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: TransformerConfig | None = None, pg_collection: Any = None) -> STDiTMegatron:
    """``pretrain()``'s model provider; installs the DSP topology from parallel_state on first use."""
    from megatron.training import get_args

    from dsp_plugin.megatron.groups import install_topology

    args = get_args()
    install_topology()
    config = model_config_from_args(args)
    return build_model(config, video_shape_from_args(args), transformer_impl=args.transformer_impl,
                       pre_process=pre_process, post_process=post_process, seed=args.init_seed,
                       pg_collection=pg_collection)
