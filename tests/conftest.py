"""Shared helpers: run the real entry point (or a test script) under torchrun in a subprocess."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipelinerl_fsdp.runtime.torchrun import ENTRY_POINT, free_port, torchrun_command
from pipelinerl_fsdp.runtime.torchrun import REPO as ROOT

__all__ = ["ROOT", "free_port", "torchrun_command"]  # the tests import these from here


def torchrun_script(
    nproc: int, script: Path, *args: str, timeout: float = 900, threads: int = 1, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc script args...` on a fresh local rendezvous; output captured."""
    cmd, env = torchrun_command(nproc, script, *args, threads=threads, max_restarts=max_restarts)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(
    nproc: int, *args: str, timeout: float = 900, threads: int = 1, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """The real job: `torchrun ... run_train.py args...`."""
    return torchrun_script(
        nproc,
        ENTRY_POINT,
        *args,
        f"--job.threads_per_rank={threads}",
        timeout=timeout,
        threads=threads,
        max_restarts=max_restarts,
    )


def pipeline_lag_bound(
    batch_size: int,
    attempts: int,
    max_num_seqs: int,
    max_queued_groups: int,
    engines: int,
    span_steps: int = 0,
    overlap_push: bool = True,
    waves: int = 1,
) -> int:
    """The largest token lag the queues allow in pipeline mode. When a group's first token is sampled, the groups
    that can be trained before it are at most: the trainer's receive queue (Q = batch_size / attempts groups, Q / waves
    with `rl.waves`) and
    the one its thread holds, and per engine its send queue, the one its sender thread holds, the one its loop holds
    while blocked on a full queue, and its other groups in flight (max_num_seqs / attempts, this one included). The
    group is then trained at most ceil((those + 1) / Q) steps later, plus `span_steps`: the trainer steps that pass
    while the group itself is still being generated. A vLLM engine core keeps decoding while our loop waits on a
    full queue, so a group with one long attempt keeps its seat while shorter groups, admitted as the trainer frees
    queue space, overtake it (measured with 2 vLLM engines, 12 steps, 6 runs: lag_max 5, 5, 3, 4, 3, 3 against 4
    from the queues alone). With `rl.overlap_push` one more: the trainer takes a batch while its last push is
    still on its way to the engines, which sample meanwhile with the version before (measured in the default job
    with the reference engine: lag_max 4 against 3 from the queues)."""
    q = batch_size // attempts
    ahead = q // waves + 1 + engines * (max_queued_groups + 2 + max_num_seqs // attempts) - 1
    return -(-(ahead + 1) // q) + span_steps + int(overlap_push)


WARMSTART_ARGS = ("--config", "arithmetic", "--job.stage=warmstart", "--world.inference_ranks=0")


@pytest.fixture(scope="session")
def default_warmstart(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The default configuration's warm start, run once per session: (HF folder, output dir, process)."""
    d = tmp_path_factory.mktemp("default_ws")
    r = torchrun(1, *WARMSTART_ARGS, f"--warmstart.path={d}/model", f"--job.output_dir={d}/out", threads=2)
    return d / "model", d / "out", r


@pytest.fixture
def warm_folder(default_warmstart) -> Path:
    """The default warm start (run once per session), so that rewards and gradients are not all zero."""
    folder, _, r = default_warmstart
    assert r.returncode == 0, r.stderr[-3000:]
    return folder
