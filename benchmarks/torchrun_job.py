"""Launch one training job under torchrun for a benchmark (the job's own entry point, this machine's Python)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_command(args: list[str], nproc: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `torchrun --standalone --nproc-per-node nproc run_train.py ARGS`."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "run_train.py"),
        *args,
    ]
    return cmd, env


def run_job(args: list[str], log: Path, nproc: int) -> None:
    """Run `job_command(args, nproc)`, output to `log`; exits with the log's tail when the job fails."""
    run_logged(*job_command(args, nproc), log)


def run_logged(cmd: list[str], env: dict[str, str], log: Path) -> None:
    """Run `cmd` in the repository root, output to `log`; exits with the log's tail when it fails."""
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"run failed ({' '.join(cmd)}); log {log}:\n{tail}")


def read_metrics(path: Path) -> list[dict]:
    """The records of a job's metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
