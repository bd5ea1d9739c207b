"""``python -m dsp_plugin.dryrun``: see :mod:`dsp_plugin.dryrun.cli`."""

from __future__ import annotations

import sys

from dsp_plugin.dryrun.cli import main

if __name__ == "__main__":
    sys.exit(main())
