"""Moved to :mod:`dsp_plugin.fake_world` (the bench uses it too); this name stays importable for now."""

from __future__ import annotations

from dsp_plugin.fake_world import fake_world

__all__ = ["fake_world"]
