"""The dry run: a training step of the real-size model on fake tensors, as one rank of a fake world.

``python -m dsp_plugin.dryrun`` (``dsp-dryrun``; ``cli``) is the command. Pieces: ``models`` (the
published configs in ``configs/`` and the video geometry), ``dsp_plugin.fake_world`` (the fake process group and topology),
``memory`` (peak bytes and FLOPs as tensors come and go), ``diffusers_family`` and
``megatron_family`` (building and feeding each kind of model), ``state`` (ZeRO's parameters,
gradients and optimizer states), ``estimate`` (the step time from the scale model), ``step``
(one dry run) and ``report``.
"""

from __future__ import annotations

from dsp_plugin.dryrun.step import DryRun, Setup, dry_run, sweep

__all__ = ["DryRun", "Setup", "dry_run", "sweep"]
