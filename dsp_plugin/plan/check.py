"""The plan checker's old name: it is ``python -m dsp_plugin.check`` now (a tool on top of the library, so that
``dsp_plugin.plan`` imports nothing above it). Running this module says so and runs the checker."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    print("dsp_plugin.plan.check is now python -m dsp_plugin.check; running that", file=sys.stderr)
    runpy.run_module("dsp_plugin.check", run_name="__main__", alter_sys=True)
