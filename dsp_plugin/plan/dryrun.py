"""The dry run's old name: it is ``python -m dsp_plugin.dryrun`` (``dsp-dryrun``) now (a tool on top of the library,
so that ``dsp_plugin.plan`` imports nothing above it). Running this module says so and runs the dry run."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    print("dsp_plugin.plan.dryrun is now python -m dsp_plugin.dryrun; running that", file=sys.stderr)
    runpy.run_module("dsp_plugin.dryrun", run_name="__main__", alter_sys=True)
