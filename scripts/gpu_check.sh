#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): one call on the lent GPU machine, under its own python3 (no .venv there).
#   bash scripts/gpu_wheels.sh               # here, once: the pure-Python wheels that image lacks, into .gpu_wheels/
#   bash scripts/gpu_check.sh [OUT]          # there (the device tool: carry .gpu_wheels; OUT defaults to $OUT)
#   bash scripts/gpu_check.sh --cpu [OUT]    # here: the rehearsal on CPU (.venv), the same parts on small shapes
#   ... [OUT] --parts rl_step,attention      # after OUT: gpu_check.py's options (--parts: which groups of parts)
set -uo pipefail
cd "$(dirname "$0")/.."
args=()
if [ "${1:-}" = "--cpu" ]; then args+=(--cpu); shift; PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
out="${OUT:-benchmarks/results/gpu_check}"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then out="$1"; shift; fi
# a pure-Python wheel is importable straight from the path (zipimport): torchdata for the job's problem streams
for w in .gpu_wheels/*.whl; do [ -e "$w" ] && PYTHONPATH="$PWD/$w${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH="${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" scripts/gpu_check.py "${args[@]}" --out "$out" "$@"
