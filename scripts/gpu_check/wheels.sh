#!/usr/bin/env bash
# Build, here, the wheels a lent GPU machine's image lacks, into .whl/ (git-ignored), at the versions of
# constraints.txt; then carry .whl in the device call, and scripts/gpu_check.sh installs them first:
#   scripts/gpu_check/wheels.sh
#   run(command="scripts/gpu_check.sh", carry=[".whl"])           # about 12 MB of the 64 MiB a call may carry
# deepspeed publishes an sdist only: its wheel is built here (pure Python; its ops are JIT-compiled there).
# Transformer Engine is not among them: its wheels are larger than a call may carry and its torch extension
# is built for one torch; scripts/gpu_check.sh skips the TE steps where TE is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
pin() { grep -i "^$1==" constraints.txt; }
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$(pin megatron-core)" "$(pin diffusers)" "$(pin hjson)" "$(pin pydantic)" \
    "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" "$(pin importlib_metadata)"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$(pin deepspeed)"
du -sh .whl && ls .whl
