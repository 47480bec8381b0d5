#!/usr/bin/env bash
# Set up the environment (first run only), lint, then run the tests: unit tests first (fast), then the end-to-end
# runs (torchrun jobs).   bash scripts/test.sh            everything (what CI runs)
#                         bash scripts/test.sh ARGS...    only `pytest ARGS...` (e.g. tests/unit, -k name)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "${EXTRAS:-test,cpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
echo "[test] ruff check + format" >&2
.venv/bin/ruff check --output-format concise .
.venv/bin/ruff format --check .
echo "[test] unit tests" >&2
.venv/bin/python -m pytest -q -ra tests/unit
echo "[test] end-to-end tests" >&2
exec .venv/bin/python -m pytest -q -ra --durations=15 tests/e2e  # the slowest, for the 25-minute budget
