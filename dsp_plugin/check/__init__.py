"""The plan checker: a plan against the model on one process, per planned module (``python -m dsp_plugin.check``).

A tool on top of the library: ``cli`` (the command: arguments, the ranks, the named tiny models of
``dsp_plugin.testing``), ``compare`` (one forward and backward on each rank beside the one-process
model), ``outputs`` (every tensor of a module's output placed and compared), ``report`` (the table,
the verdict, the tolerance, JSON). See docs/models.md, "Check a new plan".
"""

from __future__ import annotations

from dsp_plugin.check.cli import main, run_check

__all__ = ["main", "run_check"]
