#!/usr/bin/env bash
# The GPU check, for a machine with one CUDA GPU (under 8 minutes): what no CPU test can show.
#   EXTRAS=test,gpu bash scripts/setup_env.sh && bash scripts/gpu_check.sh [OUT_DIR]
# 1. our trainer step in bf16 on a Qwen2.5-0.5B-shaped model (random weights, from its config): tokens/s, MFU,
#    peak memory, with and without activation checkpointing, and the SDPA kernel packed rows get;
# 2. vLLM (CUDA, bf16) tokens/s through the job's engine class against our reference engine on the same model;
# 3. a weight update into a CUDA vLLM engine while it generates: the pause with vLLM's reload and in place
#    (over gloo: one GPU cannot hold both ends of an NCCL group; multi-GPU NCCL runs in the real job).
# Each part has its own time limit; the tables and JSON land in OUT_DIR (default benchmarks/results/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${1:-benchmarks/results/gpu_check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 1
status=0
part() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name"
  if ! timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; then echo "FAILED (log: $OUT/$name.log)"; status=1; fi
  grep -E '^\|' "$OUT/$name.log" || tail -5 "$OUT/$name.log"
}
part step_0.5b 150 "$PY" benchmarks/train_step_speed.py --flavour qwen2.5-0.5b --tokens 8192 --docs 8 \
  --out "$OUT/step_0.5b.json"
part step_0.5b_ac 150 "$PY" benchmarks/train_step_speed.py --flavour qwen2.5-0.5b --tokens 8192 --docs 8 \
  --checkpointing --out "$OUT/step_0.5b_ac.json"
part engines 150 "$PY" benchmarks/engines.py --gpu --flavours qwen2.5-0.5b --prompts 64 --max-tokens 128 \
  --out "$OUT/engines.json"
part vllm_update 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/vllm_update.py \
  --gpu --flavour qwen2.5-0.5b --updates 5 --loads reload,inplace --out "$OUT/vllm_update.json"
exit $status
