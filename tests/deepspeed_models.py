"""A small video transformer in plain PyTorch, its DSP-aware version, and the single-process oracle.

``VideoTransformer`` is written the way a user's model would be, with torch only:
a patch embedding, spatial attention over S inside each frame, temporal attention
over T at each position, an MLP and a linear head, on tokens ``[B, T, S, C]``.
``DSPVideoTransformer`` is what a user adds to make it DSP-aware without touching
the layers: the same forward with ``split`` at the entry, a ``dynamic_switch``
before the temporal attention and a ``gather`` of the head's output. The oracle
(``reference_steps``) runs ``VideoTransformer`` in one process with a torch
optimizer: no DeepSpeed and no dsp_plugin on its path.

Lengths are uneven on purpose (T=5, S=3 at DSP=2: shards of 3/2 frames and 2/1
positions), and the model is tiny so a test spends its time in DeepSpeed, not
in the math.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

T, S, C, D, HEADS = 5, 3, 4, 16, 2

Params = dict[str, np.ndarray]


class Attention(nn.Module):
    """Multi-head self-attention over dim -2 of ``[..., L, D]`` (qkv and out projections)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, L, D] -> [N, heads, L, D/heads] each for q, k, v
        n, length, dim = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        # [N, heads, L, D/heads] -> [N, L, D]
        return self.out(y.transpose(1, 2).reshape(n, length, dim))


class VideoTransformer(nn.Module):
    """Tokens ``[B, T, S, C]`` -> ``[B, T, S, C]``; spatial then temporal attention, pre-norm residuals."""

    def __init__(self, channels: int = C, dim: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Linear(channels, dim)
        self.norm_s, self.spatial = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm_t, self.temporal = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm_m = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, channels)

    def spatial_block(self, h: torch.Tensor) -> torch.Tensor:
        b, t, s, d = h.shape  # [B, T, S, D]: attention over S within each frame
        return h + self.spatial(self.norm_s(h).reshape(b * t, s, d)).reshape(b, t, s, d)

    def temporal_block(self, h: torch.Tensor) -> torch.Tensor:
        b, t, s, d = h.shape  # [B, T, S, D] -> [B*S, T, D]: attention over T at each position
        y = self.temporal(self.norm_t(h).transpose(1, 2).reshape(b * s, t, d))
        return h + y.reshape(b, s, t, d).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.spatial_block(self.embed(x))
        h = self.temporal_block(h)
        h = h + self.mlp(self.norm_m(h))
        return self.head(h)


class DSPVideoTransformer(VideoTransformer):
    """The same layers with DSP: every parameter sees sharded tokens, so gradients are per-shard partials.

    ``S(T)`` for embed and spatial attention, switch to ``S(S)`` for temporal
    attention, the MLP and the head (all per token), then one gather of the
    output so the loss sees the whole sequence on every rank.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dsp_plugin import dynamic_switch, gather, split

        t, s = x.shape[1], x.shape[2]
        h = self.spatial_block(self.embed(split(x, 1)))            # [B, T/N, S, D]
        h = self.temporal_block(dynamic_switch(h, 1, 2, global_len=t))  # [B, T, S/N, D]
        h = h + self.mlp(self.norm_m(h))
        return gather(self.head(h), 2, global_len=s)               # [B, T, S, C]


def make_plain(seed: int = 0) -> VideoTransformer:
    torch.manual_seed(seed)
    return VideoTransformer()


def make_dsp(seed: int = 0) -> DSPVideoTransformer:
    """Same initial parameters as ``make_plain`` (same seed, same construction order)."""
    torch.manual_seed(seed)
    return DSPVideoTransformer()


def batch(index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` samples (inputs, targets) for global micro-batch ``index``; deterministic."""
    g = torch.Generator().manual_seed(500 + index)
    return torch.randn(size, T, S, C, generator=g), torch.randn(size, T, S, C, generator=g)


def step_batch(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``samples`` samples of optimizer step ``step`` (DP x GAS x micro of them)."""
    return batch(step, samples)


def local_micro(step: int, micro: int, *, dp: int, dp_rank: int, gas: int, mb: int) -> tuple[torch.Tensor, ...]:
    """The samples a rank sees at micro-step ``micro`` of ``step``: rows ``[micro, dp_rank]`` of the step's batch."""
    x, y = step_batch(step, dp * gas * mb)
    start = (micro * dp + dp_rank) * mb
    return x[start:start + mb], y[start:start + mb]


def reference_steps(steps: int, *, dp: int, gas: int, mb: int, lr: float, clip: float = 0.0,
                    optimizer: str = "sgd", initial: Params | None = None) -> dict[str, Any]:
    """One process, whole batch of each step: losses, the first step's gradients, final parameters (fp32).

    ``initial`` replaces ``make_plain``'s initial values: a model built in bf16 under
    ``zero.Init`` draws other random numbers (torch's bf16 ``uniform_`` does not
    reproduce the fp32 stream for larger tensors), so such a run is compared from
    its own starting point.
    """
    torch.set_num_threads(1)
    model = make_plain()
    if initial is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    losses, first_grads = [], None
    for step in range(steps):
        x, y = step_batch(step, dp * gas * mb)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone().numpy() for n, p in model.named_parameters()}
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": first_grads,
            "params": {n: p.detach().clone().numpy() for n, p in model.named_parameters()},
            "initial": initial or {n: p.detach().numpy() for n, p in make_plain().named_parameters()}}
