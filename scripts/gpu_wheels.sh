#!/usr/bin/env bash
# The pure-Python packages the GPU machine's image lacks (Python 3.12, torch 2.11: no torchdata), as wheels in the
# git-ignored .gpu_wheels/, which the device tool carries (64 MiB at most; these are well under 1 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --dest .gpu_wheels "torchdata==0.11.0"
ls -la .gpu_wheels
