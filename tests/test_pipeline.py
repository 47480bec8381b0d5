"""The PipelineRL job end to end under torchrun: world splits, learning, metrics, failure handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, torchrun

pytestmark = pytest.mark.slow

METRIC_KEYS = {"step", "version", "wall_time_s", "samples", "reward_mean", "ess", "lag_mean", "lag_max", "entropy",
               "grad_norm", "lr", "gen_tokens_per_s", "train_tokens_per_s", "trainer_busy_frac",
               "inference_busy_frac", "update_pause_ms", "broadcast_mb_per_s", "queue_size", "dropped_stale"}


@pytest.fixture(scope="module")
def warm_folder(tmp_path_factory) -> Path:
    """A short warm start shared by the pipeline tests (the learning test makes its own, full one)."""
    d = tmp_path_factory.mktemp("ws")
    r = torchrun(1, "--config", "arithmetic", "--job.stage=warmstart", "--world.inference_ranks=0",
                 "--warmstart.steps=200", "--warmstart.eval_every=200", f"--warmstart.path={d}/m",
                 f"--job.output_dir={d}/out", "--task.eval_size=50")
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "m"


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]


def short_run(nproc: int, n_inf: int, warm: Path, out: Path, *extra: str, timeout: float = 600):
    return torchrun(nproc, "--config", "arithmetic", f"--model.path={warm}", f"--world.inference_ranks={n_inf}",
                    f"--job.output_dir={out}", "--rl.max_steps=12", "--rl.batch_size=32", "--rl.attempts=4",
                    "--inference.max_num_seqs=16", "--metrics.log_every=4", *extra, timeout=timeout)


@pytest.mark.parametrize("nproc, n_inf", [(2, 1), (3, 1), (4, 2)])
def test_short_pipeline_runs_and_logs_real_metrics(warm_folder, tmp_path, nproc, n_inf):
    r = short_run(nproc, n_inf, warm_folder, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    recs = records(tmp_path)
    assert [x["step"] for x in recs] == list(range(1, 13))
    assert METRIC_KEYS <= recs[0].keys()
    assert [x["version"] for x in recs] == list(range(1, 13))
    assert recs[0]["lag_max"] == 0 and recs[0]["ess"] == pytest.approx(1.0, abs=1e-4)  # first step: on-policy
    for x in recs:
        assert 0 < x["ess"] <= 1 + 1e-6
        assert 0 <= x["lag_mean"] <= x["lag_max"] <= 8
        assert 0 <= x["reward_mean"] <= 1
        assert x["gen_tokens_per_s"] >= 0 and x["train_tokens_per_s"] > 0
        assert 0 < x["trainer_busy_frac"] <= 1 and 0 <= x["inference_busy_frac"] <= 1.05
    assert max(x["lag_max"] for x in recs) >= 1  # engines really generate while the trainer trains
    assert any(x["update_pause_ms"] > 0 for x in recs) and recs[-1]["broadcast_mb_per_s"] > 0
    assert any((tmp_path / "rl" / "tb").iterdir())


def test_two_nodes_of_two_processes(warm_folder, tmp_path):
    """Two torchrun agents on localhost joined by a c10d rendezvous: 2 trainers on node 0, 2 engines on node 1."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    args = ["--config", "arithmetic", f"--model.path={warm_folder}", "--world.inference_ranks=2",
            f"--job.output_dir={tmp_path}", "--rl.max_steps=6", "--rl.batch_size=32", "--rl.attempts=4",
            "--inference.max_num_seqs=16", "--job.threads_per_rank=1"]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "2", "--node-rank", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", f"t{port}", str(ROOT / "run_train.py"), *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-3000:] for o in outs)
    assert [x["version"] for x in records(tmp_path)] == list(range(1, 7))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failing_rank_brings_the_job_down_quickly(warm_folder, tmp_path, rank):
    env_fault = f"{rank}:3"
    os.environ["PIPELINERL_FAULT"] = env_fault
    try:
        t0 = time.time()
        r = short_run(2, 1, warm_folder, tmp_path, timeout=180)
        elapsed = time.time() - t0
    finally:
        del os.environ["PIPELINERL_FAULT"]
    assert r.returncode != 0
    assert "InjectedFault" in r.stderr and f"[rank {rank}] failed" in r.stderr
    assert elapsed < 60 + 30  # start-up included; the tear-down itself is seconds
