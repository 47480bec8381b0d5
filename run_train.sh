#!/usr/bin/env bash
# Set up the environment (first run only) and launch one torchrun job.
#   bash run_train.sh [--config NAME_OR_PATH] [--section.key=value ...]
# Environment: NPROC_PER_NODE (default 2: the default config has 1 inference + 1 trainer rank), NNODES (1), NODE_RANK (0), RDZV_ENDPOINT (host:port, multi-node),
# RDZV_ID, EXTRAS (pip extras for setup, default "test,cpu"; "test,gpu" on CUDA machines), SKIP_SETUP=1 to use the current Python as is,
# MAX_RESTARTS (torchrun --max-restarts; default: the config's job.max_restarts).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup_env.sh "${EXTRAS:-test,cpu}"
  PY=.venv/bin/python
else
  PY="${PYTHON:-python3}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))
fi
args=(--config arithmetic)
for a in "$@"; do case "$a" in --config|--config=*) args=() ;; esac; done
# the config is checked here first (a bad key fails in one process, before any rank starts)
MAX_RESTARTS="${MAX_RESTARTS:-$("$PY" -m pipelinerl_fsdp.launch max-restarts "${args[@]}" "$@")}"
if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  exec "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \
    --max-restarts "$MAX_RESTARTS" run_train.py "${args[@]}" "$@"
fi
# multi-node: a rendezvous host this node cannot resolve or reach, or a gloo interface other nodes cannot reach, is
# named here within seconds (torchrun would retry for a minute or more, or fail later naming neither)
"$PY" -m pipelinerl_fsdp.runtime.network "$RDZV_ENDPOINT" || exit 2
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --max-restarts "$MAX_RESTARTS" --node-rank "${NODE_RANK:-0}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" \
  --rdzv-id "${RDZV_ID:-pipelinerl}" run_train.py "${args[@]}" "$@"
