"""How vLLM's own processes start: the environment they inherit (their cores or GPUs, spawn, the model runner),
without torchrun's variables, and with vLLM's logs turned down."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from pipelinerl_fsdp.inference.placement import VLLMPlacement


def engine_env(placement: VLLMPlacement, current: Mapping[str, str]) -> dict[str, str]:
    """Environment variables set before vLLM starts its processes (they inherit this process's environment)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine core in a process of its own (docs/vllm.md)
    if placement.gpu_ids is None:
        if placement.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = placement.cpu_cores
        return env
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.gpu_ids))
    # fresh interpreters for vLLM's processes: a child forked after CUDA was initialised cannot use it (this rank
    # never initialises it, but a spawned child does not depend on that)
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # the V1 model runner, whose per-request token counts (the version boundaries of an update) the CPU tests check
    # against a reference; the extension also reads V2's (`VLLM_USE_V2_MODEL_RUNNER=1`), which no machine of ours
    # has run (docs/vllm.md)
    env["VLLM_USE_V2_MODEL_RUNNER"] = current.get("VLLM_USE_V2_MODEL_RUNNER", "0")
    return env


# What torchrun tells its workers. vLLM's engine core and workers inherit the environment of the process that
# starts them, and vLLM reads some of these (its distributed set-up, the "external_launcher" executor); they
# describe our job, not vLLM's world of one engine, so vLLM starts without them.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@contextmanager
def without_torchrun_env() -> Iterator[None]:
    """Hide torchrun's variables (`TORCHRUN_VARS`, `TORCHELASTIC_*`) from what starts inside the block."""
    hidden = {k: v for k, v in os.environ.items() if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_")}
    for k in hidden:
        del os.environ[k]
    # the restart count under our own name, for fault injection in vLLM's processes (runtime/faults.py)
    os.environ["PIPELINERL_RESTART_COUNT"] = hidden.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        yield
    finally:
        os.environ.pop("PIPELINERL_RESTART_COUNT", None)
        os.environ.update(hidden)


def quiet_vllm_logs() -> None:
    """vLLM's own logs down to errors, in this process and the engine processes it starts; in those processes
    also Python's deprecation warnings (vLLM's use of torch) and torch's C++ warnings (Triton, NUMA binding)."""
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    os.environ["PYTHONWARNINGS"] = "ignore::FutureWarning,ignore::DeprecationWarning"
