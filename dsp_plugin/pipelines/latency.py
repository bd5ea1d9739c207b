"""The latency bench's old name: it is ``python -m dsp_plugin.bench.latency`` now (a tool, so that the samplers
import no bench). Running this module says so and runs it."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    print("dsp_plugin.pipelines.latency is now python -m dsp_plugin.bench.latency; running that", file=sys.stderr)
    runpy.run_module("dsp_plugin.bench.latency", run_name="__main__", alter_sys=True)
