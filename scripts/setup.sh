#!/usr/bin/env bash
# Create the project's Python 3.12 virtual environment with the pinned versions.
# Usage: scripts/setup.sh [VENV_DIR]   (default .venv). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}

find_python() {
    for candidate in "${PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "setup: Python 3.12 not found (megatron-core >= 0.17 needs it); set PYTHON=/path/to/python3.12" >&2
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    python=$(find_python)
    echo "setup: creating $venv with $python"
    "$python" -m venv "$venv"
else
    # An existing venv may be shared (a symlink, another checkout's): say which, and do not repoint
    # its editable dsp_plugin at this checkout unless asked to.
    real=$(cd "$venv" && pwd -P)
    installed=$(cd / && env -u PYTHONPATH "$real/bin/python" -c 'import importlib.util, os
spec = importlib.util.find_spec("dsp_plugin")
print(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) if spec and spec.origin else "")' 2>/dev/null || true)
    here=$(pwd -P)
    echo "setup: updating the existing venv $venv ($real)"
    if [ -n "$installed" ] && [ "$installed" != "$here" ] && [ -z "${DSP_SETUP_FORCE:-}" ]; then
        echo "setup: $real has dsp_plugin installed from $installed, not from this checkout ($here);" \
             "installing here would repoint it for every user of that venv. Use a venv of your own" \
             "(make VENV=.venv-mine ...), or DSP_SETUP_FORCE=1 to repoint it." >&2
        exit 1
    fi
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
echo "setup: installing pinned dependencies (torch for 3.12 from PyPI is the CUDA build, ~3 GB; a few minutes the first time)"
"$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[test,megatron,deepspeed,bench,diffusers]"
touch "$venv/.installed"
echo "setup: done ($("$venv/bin/python" -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("torch", "deepspeed", "megatron-core", "diffusers")))'))"
