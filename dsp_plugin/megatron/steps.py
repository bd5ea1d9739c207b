"""What a ``megatron.training`` launch plugs in: dataset, model provider, forward step, loss.

Used by ``dsp_plugin/launch/pretrain_stdit.py`` (GPU: ``pretrain()``; CPU: ``cpu.py``) and by
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

from dsp_plugin.comm import split
from dsp_plugin.megatron.config import DSPTransformerConfig, output_shard_dim
from dsp_plugin.megatron.layers import dsp_layer_spec
from dsp_plugin.megatron.model import STDiTMegatron, VideoShape

__all__ = ["SyntheticVideoDataset", "add_model_arguments", "build_model", "forward_step", "loss_func",
           "model_provider", "reference_weights", "video_shape_from_args"]


class SyntheticVideoDataset(torch.utils.data.Dataset):
    """Deterministic synthetic video latents: sample ``i`` depends only on ``(seed, i)``.

    Each item: ``latents`` (noisy latent video) and ``target`` (the noise to
    predict), both ``[C, T, H, W]``, an integer diffusion ``timestep`` (an integer,
    so ``Float16Module`` does not round it to bf16) and, with ``text_dim``, a
    ``text`` embedding ``[text_len, text_dim]``. No downloads.

    ``varying_captions``: each caption has its own length in ``[1, text_len]`` and the
    item gets ``text_mask [text_len]`` (True: a caption token; the rest is padding).
    ``buckets``: ``(frames, height, width)`` per bucket; samples ``[k * bucket_size,
    (k + 1) * bucket_size)`` take bucket ``k % len(buckets)`` (with ``bucket_size`` the
    global batch, every batch is one bucket and the next one changes it).
    """

    def __init__(self, video: VideoShape, num_samples: int, *, seed: int = 1234, text_dim: int | None = None,
                 text_len: int = 4, varying_captions: bool = False,
                 buckets: tuple[tuple[int, int, int], ...] = (), bucket_size: int = 1) -> None:
        self.video, self.num_samples, self.seed = video, num_samples, seed
        self.text_dim, self.text_len, self.varying_captions = text_dim, text_len, varying_captions
        self.buckets, self.bucket_size = tuple(tuple(b) for b in buckets), bucket_size
        if any(len(b) != 3 or min(b) < 1 for b in self.buckets) or bucket_size < 1:
            raise ValueError(f"SyntheticVideoDataset: buckets={buckets!r} must be (frames, height, width) "
                             f"triples of positive ints and bucket_size={bucket_size} positive")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        v = self.video
        if self.buckets:
            frames, height, width = self.buckets[(index // self.bucket_size) % len(self.buckets)]
            v = VideoShape(v.channels, frames, height, width)
        clean = torch.randn(v.channels, v.frames, v.height, v.width, generator=gen)
        noise = torch.randn(v.channels, v.frames, v.height, v.width, generator=gen)
        timestep = torch.randint(0, 1000, (), generator=gen)
        alpha = torch.cos(timestep.float() / 1000 * torch.pi / 2)
        item = {"latents": alpha * clean + (1 - alpha**2).sqrt() * noise, "target": noise, "timestep": timestep}
        if self.text_dim:
            item["text"] = torch.randn(self.text_len, self.text_dim, generator=gen)
            if self.varying_captions:
                length = int(torch.randint(1, self.text_len + 1, (), generator=gen))
                item["text_mask"] = torch.arange(self.text_len) < length
        return item


def dsp_config(video: VideoShape, **transformer_config: Any) -> DSPTransformerConfig:
    """A ``DSPTransformerConfig`` for ``video`` (what ``model_provider`` builds from the arguments)."""
    return DSPTransformerConfig(**transformer_config)  # the geometry is each batch's own, not the config's


def reference_weights(config: DSPTransformerConfig, video: VideoShape, text_dim: int | None,
                      seed: int) -> dict[str, torch.Tensor]:
    """State dict of the plain-torch reference ``STDiT`` drawn with ``seed`` (same on every rank).

    Only the CPU generator is touched, and put back: the reference is built on the CPU with torch's
    initialisers, which draw from the default CPU generator, so that generator is forked and seeded
    (``torch.manual_seed`` would also reseed every GPU's generator, which ``fork_rng(devices=[])`` does not
    restore: after Megatron's per-stage seeding, every stage's CUDA stream would restart at ``seed``).
    """
    from dsp_plugin.megatron.weights import reference_config
    from dsp_plugin.models.stdit import STDiT

    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        return STDiT(reference_config(config, video.channels, text_dim, weights_only=True)).state_dict()


def build_model(config: DSPTransformerConfig, video: VideoShape, *, transformer_impl: str = "local",
                text_dim: int | None = None, text_len: int = 0, pre_process: bool = True,
                post_process: bool = True, seed: int | None = None, pg_collection: Any = None) -> STDiTMegatron:
    """One pipeline stage; with ``seed``, the weights of the reference ``STDiT`` drawn with that seed.

    The model's own modules (embeddings, adaLN, head) are created where megatron-core creates its
    layers' parameters (``weights.parameter_device``: the current CUDA device unless
    ``use_cpu_initialization``), not on the CPU beside TE parameters on the GPU.
    """
    from dsp_plugin.megatron.weights import load_reference_weights, parameter_device

    with torch.device(parameter_device(config)):
        model = STDiTMegatron(config, dsp_layer_spec(transformer_impl, cross_attention=bool(text_dim)), video,
                              text_dim=text_dim, text_len=text_len, pre_process=pre_process,
                              post_process=post_process, pg_collection=pg_collection)
    model.model_type = ModelType.encoder_or_decoder  # what megatron.training's get_model sets
    if seed is not None:
        load_reference_weights(model, reference_weights(config, video, text_dim, seed))
    return model


def loss_func(target: torch.Tensor, num_layers: int, config: DSPTransformerConfig,
              output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Local share of the per-sample MSE on this rank's shard (see the module docstring)."""
    batch, channels, frames, height, width = target.shape
    tokens = target.permute(0, 2, 3, 4, 1).reshape(batch, frames, height * width, channels)
    group = ps.get_context_parallel_group()
    local_target = split(tokens, output_shard_dim(config, num_layers), group=group)  # data: no gradient
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
    text = batch["text"].to(device) if "text" in batch else None
    text_mask = batch["text_mask"].to(device) if "text_mask" in batch else None
    output = model(latents, batch["timestep"].to(device), text, text_mask)
    config = _unwrap(model).config
    return output, partial(loss_func, target, config.num_layers, config)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


# -- megatron.training glue ---------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Latent video geometry and text conditioning of the synthetic data (Megatron has no such options)."""
    group = parser.add_argument_group(title="spatial-temporal model (dsp_plugin)")
    group.add_argument("--latent-channels", type=int, default=4)
    group.add_argument("--num-frames", type=int, default=8, help="latent frames T")
    group.add_argument("--latent-height", type=int, default=4, help="latent patches along H")
    group.add_argument("--latent-width", type=int, default=4, help="latent patches along W")
    group.add_argument("--text-dim", type=int, default=16, help="text embedding width; 0: no cross-attention")
    group.add_argument("--text-len", type=int, default=4, help="text tokens per sample")
    group.add_argument("--dsp-attend-pattern", type=_attend_pattern, default=("spatial", "temporal"),
                       help="layer kinds, repeated over the layers: spatial, temporal, or full (every token, "
                            "through the head switch), e.g. spatial,temporal,full")
    group.add_argument("--varying-captions", action="store_true",
                       help="captions of varying length in [1, --text-len], masked in cross-attention")
    group.add_argument("--video-buckets", type=str, default=None,
                       help="'T,H,W;T,H,W;...': latent geometry per bucket; each global batch takes the next "
                            "bucket (frames and resolution change between batches, no restart)")
    group.add_argument("--adaln-single", action="store_true", dest="dsp_adaln_single",
                       help="PixArt / OpenSora adaLN-single instead of a per-layer adaLN linear")
    group.add_argument("--spatial-rope", action="store_true", dest="dsp_spatial_rope",
                       help="with --position-embedding-type rope: 2-D RoPE in spatial layers too")
    group.add_argument("--init-seed", type=int, default=None,
                       help="initialise weights from the plain-torch reference STDiT drawn with this seed "
                            "(independent of TP/DSP/PP: comparable loss curves)")
    return parser


def _attend_pattern(text: str) -> tuple[str, ...]:
    from dsp_plugin.megatron.config import ATTEND

    kinds = tuple(kind.strip() for kind in text.split(","))
    if not all(kind in ATTEND for kind in kinds):
        raise argparse.ArgumentTypeError(f"--dsp-attend-pattern {text!r}: expected comma-separated kinds of "
                                         f"{sorted(ATTEND)}")
    return kinds


def video_buckets_from_args(args: argparse.Namespace) -> tuple[tuple[int, int, int], ...]:
    """``--video-buckets 'T,H,W;...'`` -> ``((T, H, W), ...)``; empty without the flag."""
    spec = getattr(args, "video_buckets", None)
    if not spec:
        return ()
    try:
        buckets = tuple(tuple(int(v) for v in part.split(",")) for part in spec.split(";") if part.strip())
    except ValueError:
        buckets = ()
    if not buckets or any(len(b) != 3 or min(b) < 1 for b in buckets):
        raise ValueError(f"--video-buckets {spec!r}: expected 'T,H,W;T,H,W;...' with positive integers")
    return buckets


def video_shape_from_args(args: argparse.Namespace) -> VideoShape:
    return VideoShape(args.latent_channels, args.num_frames, args.latent_height, args.latent_width)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The DiT MLP activation (OpenSora, the reference): tanh-approximated GELU."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def model_config_from_args(args: argparse.Namespace) -> DSPTransformerConfig:
    """Megatron's config from the arguments, as a ``DSPTransformerConfig`` with attention kept local.

    The CP slot of parallel_state holds DSP; the layers must see ``context_parallel_size=1``
    or TE starts ring attention.
    """
    from megatron.training.argument_utils import core_transformer_config_from_args

    saved = args.context_parallel_size
    args.context_parallel_size = 1
    try:
        config = core_transformer_config_from_args(args, config_class=DSPTransformerConfig)
    finally:
        args.context_parallel_size = saved
    if config.activation_func is torch.nn.functional.gelu and not config.bias_activation_fusion:
        # the DiT's GELU is the tanh approximation. Megatron's default --bias-gelu-fusion keeps F.gelu as the
        # marker its MLP dispatches on ("Only support fusion of gelu and swiglu" for anything else), and its
        # fused kernel (megatron.core.fusions.fused_bias_gelu.bias_gelu) already is the tanh approximation
        config.activation_func = gelu_tanh
    if ps.get_pipeline_model_parallel_world_size() > 1:
        config.variable_seq_lengths = True  # uneven shards and buckets: let Megatron exchange p2p shapes
    return config


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None) -> STDiTMegatron:
    """``pretrain()``'s model provider; installs the DSP topology from parallel_state on first use."""
    from megatron.training import get_args

    from dsp_plugin.megatron.groups import install_topology

    args = get_args()
    install_topology()
    config = model_config_from_args(args)
    return build_model(config, video_shape_from_args(args), transformer_impl=args.transformer_impl,
                       text_dim=args.text_dim or None, text_len=args.text_len, pre_process=pre_process,
                       post_process=post_process, seed=args.init_seed, pg_collection=pg_collection)
