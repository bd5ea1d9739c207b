#!/usr/bin/env bash
# Megatron-LM + DSP launch. Every knob is an environment variable with a default:
#
#   NPROC=4 TP=2 DSP=2 PP=1 ./launch/run_megatron.sh           # TP=2 x DSP=2
#   NPROC=4 DSP=4 ./launch/run_megatron.sh                     # DSP=4
#   NPROC=4 PP=2 DSP=2 ./launch/run_megatron.sh                # PP=2 x DSP=2
#   MODE=none NPROC=1 DSP=1 ./launch/run_megatron.sh           # no DSP (single process baseline)
#   IMPL=transformer_engine FP8=hybrid ./launch/run_megatron.sh  # GPU: TE layers, FP8 autocast
#   EVAL_ITERS=2 EVAL_INTERVAL=2 ./launch/run_megatron.sh        # validation loss every 2 iterations
#   ./launch/run_megatron.sh --save /tmp/ckpt --save-interval 2   # Megatron checkpoints (torch_dist);
#   ITERS=6 ./launch/run_megatron.sh --load /tmp/ckpt             # resume (same or another DSP size, more iters)
#   MASTER_PORT=29600 ./launch/run_megatron.sh                    # rendezvous port (default: a free one)
#
# Extra Megatron arguments pass through: ./launch/run_megatron.sh --log-interval 1
# On a machine without CUDA the same command runs on gloo (see dsp_plugin/launch/pretrain_stdit.py).
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}            # processes on this node
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}      # this node (0 .. NNODES-1)
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-}     # rendezvous port; default: a free one (multi-node: required, same everywhere)
MODE=${MODE:-dsp}            # --sequence-parallel-mode: dsp | none
TP=${TP:-1}                  # tensor parallel
DSP=${DSP:-$(( NPROC * NNODES / TP / ${PP:-1} ))}  # DSP size (default: all ranks TP and PP leave)
PP=${PP:-1}                  # pipeline parallel
MBS=${MBS:-1}                # micro batch size
GBS=${GBS:-4}                # global batch size
ITERS=${ITERS:-3}
LAYERS=${LAYERS:-4}          # alternating spatial / temporal blocks
HIDDEN=${HIDDEN:-32}
HEADS=${HEADS:-4}
FRAMES=${FRAMES:-8}          # latent frames T
HEIGHT=${HEIGHT:-2}          # latent patches H (S = H * W)
WIDTH=${WIDTH:-3}
CHANNELS=${CHANNELS:-4}
TEXT_DIM=${TEXT_DIM:-16}      # text embedding width for cross-attention (0: none)
TEXT_LEN=${TEXT_LEN:-4}
EVAL_ITERS=${EVAL_ITERS:-0}   # validation batches per evaluation (Megatron's --eval-iters)
EVAL_INTERVAL=${EVAL_INTERVAL:-1000000}
LR_SCHEDULE=${LR_SCHEDULE:-command-line}  # on --load: command-line (this line's ITERS and LR win) | checkpoint
IMPL=${IMPL:-local}          # --transformer-impl: local | transformer_engine
FP8=${FP8:-}                 # --fp8-format (e4m3 | hybrid), GPU + TE only
SEED=${SEED:-1234}
PYTHON=${PYTHON:-.venv/bin/python}
SCRIPT=${SCRIPT:--m dsp_plugin.launch.pretrain_stdit}  # what torchrun runs: a file, or -m module

if [[ -z "$MASTER_PORT" ]]; then  # a free port, so that two launches on one machine do not clash
    if (( NNODES > 1 )); then echo "run_megatron.sh: set MASTER_PORT (the same on every node)" >&2; exit 2; fi
    MASTER_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

# CUDA_VISIBLE_DEVICES set and empty hides every GPU: the CPU path, without a python importing torch to ask (4 s)
if [[ "${CUDA_VISIBLE_DEVICES-unset}" != "" ]] \
        && "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    BACKEND=nccl; DTYPE_ARGS=(--bf16)
else
    BACKEND=gloo; DTYPE_ARGS=(); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron requires it for TP/CP > 1 before Blackwell

ARGS=(
    --sequence-parallel-mode "$MODE"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --ffn-hidden-size $(( 4 * HIDDEN )) --seq-length $(( FRAMES * HEIGHT * WIDTH ))
    --max-position-embeddings $(( FRAMES * HEIGHT * WIDTH ))
    --latent-channels "$CHANNELS" --num-frames "$FRAMES" --latent-height "$HEIGHT" --latent-width "$WIDTH"
    --text-dim "$TEXT_DIM" --text-len "$TEXT_LEN" --norm-epsilon 1e-6
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
    --lr 1e-3 --min-lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --clip-grad 0
    --hidden-dropout 0 --attention-dropout 0 --normalization LayerNorm
    --transformer-impl "$IMPL" --no-gradient-accumulation-fusion --no-bias-dropout-fusion
    --no-masked-softmax-fusion --no-persist-layer-norm --use-cpu-initialization
    --distributed-backend "$BACKEND" --distributed-timeout-minutes 5
    --seed "$SEED" --init-seed "$SEED" --log-interval 1 --eval-iters "$EVAL_ITERS" --eval-interval "$EVAL_INTERVAL"
    --num-workers "${WORKERS:-0}"
    "${DTYPE_ARGS[@]}"
)
if [[ "$MODE" == dsp ]]; then ARGS+=(--dsp-size "$DSP"); fi
case "$LR_SCHEDULE" in  # Megatron asserts that a loaded scheduler matches unless told which one wins
    command-line) ARGS+=(--override-opt_param-scheduler) ;;
    checkpoint) ARGS+=(--use-checkpoint-opt_param-scheduler) ;;
    *) echo "run_megatron.sh: LR_SCHEDULE=$LR_SCHEDULE; expected command-line or checkpoint" >&2; exit 2 ;;
esac
if [[ -n "$FP8" ]]; then ARGS+=(--fp8-format "$FP8"); fi

exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    $SCRIPT "${ARGS[@]}" "$@"
