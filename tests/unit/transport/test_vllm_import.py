"""Importing vLLM's communicator on the first trainer rank (the only trainer rank that imports vLLM) leaves that
rank's environment, and Inductor's compile-thread count, as on every other trainer rank. In a fresh process: the
change happens at vLLM's first import only (~3 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, os, sys
import torch._inductor.config as inductor  # sets Inductor's own cache folder, on any rank that imports it
before = dict(os.environ)
from pipelinerl_fsdp.transport import store_group
store_group.import_vllm_nccl()
after = dict(os.environ)
keys = before.keys() | after.keys()
print(json.dumps({
    "vllm_imported": "vllm" in sys.modules,
    "env_changed": {k: [before.get(k), after.get(k)] for k in keys if before.get(k) != after.get(k)},
    "recorded": store_group.VLLM_IMPORT_ENV,
    "compile_threads": inductor.compile_threads,
    "compile_threads_from_our_env": inductor.decide_compile_threads(),
}))
"""

# set by `import vllm` (vllm/env_override.py); a pytest process that imported vLLM already has them
VLLM_SETS = ("TORCHINDUCTOR_COMPILE_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK", "TRITON_CACHE_AUTOTUNING")


def test_a_trainer_ranks_environment_is_unchanged_by_importing_vllm():
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k not in VLLM_SETS}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vllm_imported"]
    assert got["env_changed"] == {}
    # vLLM did set them, and they were put back (kept for the record)
    assert got["recorded"]["TORCHINDUCTOR_COMPILE_THREADS"] == [None, "1"]
    assert got["recorded"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == [None, "1"]
    assert got["compile_threads"] == got["compile_threads_from_our_env"]
