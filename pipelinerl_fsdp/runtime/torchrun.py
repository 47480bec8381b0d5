"""The command line of a job on this machine under torchrun (one node, a fresh rendezvous on a free local port):
what the tests and the benchmarks start the job's entry point, or a script or module of theirs, with."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

# the repository: where run_train.py, benchmarks/ and tests/ are, and the processes' working directory
REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO / "run_train.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(
    nproc: int,
    target: str | Path,
    *args: str,
    module: bool = False,
    threads: int = 1,
    max_restarts: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `torchrun --nproc-per-node nproc [-m] target args...` with this Python, on
    a fresh rendezvous; `target` is a script's path, or with `module` a module's name (`-m`, as `python -m`). The
    environment: `threads` OpenMP threads per process, no Hugging Face downloads, unbuffered output, and the
    repository first on PYTHONPATH (the package, `benchmarks`, a test's helpers)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        *(["-m"] if module else []),
        str(target),
        *args,
    ]
    return cmd, env


def job_command(nproc: int, *args: str, threads: int = 1, max_restarts: int = 0) -> tuple[list[str], dict[str, str]]:
    """`torchrun_command` of the job itself (`run_train.py args...`)."""
    return torchrun_command(nproc, ENTRY_POINT, *args, threads=threads, max_restarts=max_restarts)
