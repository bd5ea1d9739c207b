"""``python -m dsp_plugin.check``: see :mod:`dsp_plugin.check.cli`."""

from __future__ import annotations

import sys

from dsp_plugin.check.cli import main

if __name__ == "__main__":
    sys.exit(main())
