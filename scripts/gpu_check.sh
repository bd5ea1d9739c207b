#!/usr/bin/env bash
# The checks only a GPU can settle, most likely to fail first. Each step prints one line:
#   PASS|FAIL|SKIP  <step>  <its figure>
# and writes its whole output to $GPU_CHECK_LOGS/<step>.log (default out/gpu_check).
#
#   scripts/gpu_check.sh                    # every step
#   scripts/gpu_check.sh --dry-run          # print the steps' commands, run nothing (the test suite does this)
#   scripts/gpu_check.sh te primitives      # the named steps only
#
# Exit status: the number of FAILs (0: nothing failed; SKIPs name what the machine lacks).
# On a lent device machine (docs/gpu.md): its image has torch but none of deepspeed, megatron-core and
# diffusers; build their wheels here with scripts/gpu_check/wheels.sh, carry .whl, and this script installs
# them first (into /tmp/site, as /work/.library/device/README.md describes). PYTHON picks the interpreter
# (default: .venv/bin/python when present, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LOGS=${GPU_CHECK_LOGS:-out/gpu_check}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
P="$PYTHON"
G=scripts/gpu_check

# name | command. Order: risk (an import against this torch first, sampling last).
STEPS=(
    "te|$P $G/te_import.py"
    "pytest-gpu|$P -m pytest -q -m gpu \$(grep -l 'mark.gpu' tests/test_*.py)"
    "megatron-te-fp8|$P $G/megatron.py te-fp8"
    "megatron-distopt|$P $G/megatron.py distopt"
    "megatron-dsp2-gloo|$P $G/megatron.py dsp2"
    "primitives|$P $G/primitives.py"
    "compile|$P $G/compile.py --nproc 1 --backend nccl"
    "compile-gloo2|$P $G/compile.py"
    "fp8-payload|$P $G/fp8_payload.py"
    "deepspeed-zero2-fp16|$P $G/deepspeed.py --zero 2 --precision fp16"
    "deepspeed-zero2-bf16|$P $G/deepspeed.py --zero 2 --precision bf16"
    "deepspeed-zero3-fp16|$P $G/deepspeed.py --zero 3 --precision fp16"
    "deepspeed-zero3-bf16|$P $G/deepspeed.py --zero 3 --precision bf16"
    "attention|$P $G/attention.py"
    "sampling|$P $G/sampling.py"
    "figures|$P $G/figures.py"
)

DRY=0
WANTED=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (expected --dry-run, --help or step names)" >&2; exit 2 ;;
        *) WANTED+=("$arg") ;;
    esac
done
for name in "${WANTED[@]}"; do
    if ! printf '%s\n' "${STEPS[@]}" | grep -q "^$name|"; then
        echo "gpu_check.sh: no step '$name'; steps: $(printf '%s\n' "${STEPS[@]}" | cut -d'|' -f1 | xargs)" >&2
        exit 2
    fi
done

selected() {
    [[ ${#WANTED[@]} -eq 0 ]] && return 0
    local name
    for name in "${WANTED[@]}"; do [[ "$name" == "$1" ]] && return 0; done
    return 1
}

if (( DRY )); then
    for step in "${STEPS[@]}"; do
        name=${step%%|*}
        selected "$name" && printf '%-22s %s\n' "$name" "${step#*|}"
    done
    exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then   # wheels carried to a device machine, installed once per machine
    [[ -f /tmp/site/.gpu_check_installed ]] || "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 1; }
    touch /tmp/site/.gpu_check_installed
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$LOGS"
"$PYTHON" - <<'PY'
import torch
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name() if cuda else "no CUDA device"
cap = ".".join(map(str, torch.cuda.get_device_capability())) if cuda else "-"
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), {name}, sm {cap}")
PY

FAILS=0
for step in "${STEPS[@]}"; do
    name=${step%%|*}
    selected "$name" || continue
    log="$LOGS/$name.log"
    start=$SECONDS
    timeout "$STEP_TIMEOUT" bash -c "${step#*|}" > "$log" 2>&1
    rc=$?
    figure=$(grep '^figure: ' "$log" | tail -1 | cut -c9-)
    if [[ "$name" == pytest-gpu ]]; then   # pytest's own summary is the figure; nothing run is a SKIP
        figure=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$log" | tail -1)
        if (( rc == 5 )) || { (( rc == 0 )) && ! grep -q ' passed' <<< "$figure"; }; then rc=77; fi
    fi
    case $rc in
        0) status=PASS ;;
        77) status=SKIP ;;
        124) status=FAIL; figure="timed out after ${STEP_TIMEOUT}s" ;;
        *) status=FAIL; figure=${figure:-"exit status $rc; see $log"} ;;
    esac
    [[ $status == FAIL ]] && FAILS=$((FAILS + 1))
    printf '%-4s  %-22s %s  (%ss)\n' "$status" "$name" "${figure:-}" "$((SECONDS - start))"
done
echo "gpu_check: $FAILS step(s) failed; logs in $LOGS/"
exit "$FAILS"
