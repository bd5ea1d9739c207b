#!/usr/bin/env bash
# Train the tiny STDiT with DeepSpeed + DSP. Knobs (environment, with defaults):
#   NPROC=4 DSP=2 ZERO=2 PRECISION=fp32|bf16|fp16 ITERS=10 LAUNCHER=deepspeed|torchrun MASTER_PORT=29500
#   (STEPS and PORT: deprecated names of ITERS and MASTER_PORT, still read, with a warning)
#   CONFIG=launch/ds_config_dsp.json
#   HOSTFILE=hostfile (deepspeed launcher on several nodes: lines "node0 slots=8"; NPROC is per node)
# e.g.  NPROC=4 DSP=2 ZERO=3 ./launch/run_deepspeed.sh --save-dir /tmp/ckpt --save-at 5
#       NPROC=2 DSP=2 ZERO=3 PRECISION=bf16 ./launch/run_deepspeed.sh --losses-json /tmp/bf16.json
# (fp16 needs a GPU: DeepSpeed's CPU accelerator refuses it without mkldnn fp16.)
# Extra arguments go to dsp_plugin/launch/train_deepspeed.py (e.g. --timeout 30: seconds a collective waits
# for a dead or frozen peer, default 120). CPU + gloo unless DeepSpeed finds an accelerator.
set -euo pipefail
cd "$(dirname "$0")/.."

for arg in "$@"; do   # one help, not one per process: the knobs above, then the script's options
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo
    if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi
    exec "${PYTHON:-python}" -m dsp_plugin.launch.train_deepspeed --help
  fi
done

NPROC=${NPROC:-4}
DSP=${DSP:-2}
ZERO=${ZERO:-2}
if [[ -n "${STEPS:-}" ]]; then  # the names of run_megatron.sh (ITERS) and torchrun (MASTER_PORT) everywhere
  echo "run_deepspeed.sh: STEPS is deprecated; use ITERS=$STEPS" >&2; ITERS=${ITERS:-$STEPS}
fi
if [[ -n "${PORT:-}" ]]; then
  echo "run_deepspeed.sh: PORT is deprecated; use MASTER_PORT=$PORT" >&2; MASTER_PORT=${MASTER_PORT:-$PORT}
fi
ITERS=${ITERS:-10}
LAUNCHER=${LAUNCHER:-deepspeed}
PRECISION=${PRECISION:-fp32}
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-launch/ds_config_dsp.json}
# The project's venv (scripts/setup.sh) when present, so python, deepspeed and torchrun resolve there.
if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

case "$PRECISION" in
  fp32|bf16|fp16) ;;
  *) echo "PRECISION must be fp32, bf16 or fp16, got '$PRECISION'" >&2; exit 2 ;;
esac

# The config with this run's DSP size, ZeRO stage and precision; the key itself comes from CONFIG.
# Written inside the checkout (out/), which multi-node runs share: every node reads the same file.
mkdir -p out
RUN_CONFIG=$(mktemp -p "$PWD/out" ds_config_run.XXXXXX.json)
trap 'rm -f "$RUN_CONFIG"' EXIT
"$PYTHON" - "$CONFIG" "$DSP" "$ZERO" "$PRECISION" "$RUN_CONFIG" <<'PY'
import json, sys
src, dsp, zero, precision, dst = sys.argv[1:]
config = json.load(open(src))
config["sequence_parallel_size"] = int(dsp)
config.setdefault("zero_optimization", {})["stage"] = int(zero)
for key in ("bf16", "bfloat16", "fp16"):
    config.pop(key, None)
if precision != "fp32":
    config[precision] = {"enabled": True}
json.dump(config, open(dst, "w"), indent=1)
PY

ARGS=(dsp_plugin.launch.train_deepspeed --deepspeed_config "$RUN_CONFIG" --steps "$ITERS" "$@")
case "$LAUNCHER" in
  deepspeed) deepspeed ${HOSTFILE:+--hostfile "$HOSTFILE"} --num_gpus "$NPROC" --master_port "$MASTER_PORT" \
               --module "${ARGS[@]}" ;;
  torchrun)  torchrun --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" -m "${ARGS[@]}" ;;
  *) echo "LAUNCHER must be deepspeed or torchrun, got '$LAUNCHER'" >&2; exit 2 ;;
esac
