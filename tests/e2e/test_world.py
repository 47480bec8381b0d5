"""The torchrun world of the PipelineRL job: two nodes of two processes, and one or two trainer ranks taking the
same gradient on the same batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from jobs import REF, records

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow


def test_two_nodes_of_two_processes(warm_folder, tmp_path):
    """Two torchrun agents on localhost joined by a c10d rendezvous: 2 trainers on node 0, 2 engines on node 1."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    args = [
        "--config",
        "arithmetic",
        f"--model.path={warm_folder}",
        "--world.inference_ranks=2",
        f"--job.output_dir={tmp_path}",
        "--rl.max_steps=6",
        "--rl.batch_size=32",
        "--rl.attempts=4",
        "--inference.max_num_seqs=16",
        "--job.threads_per_rank=1",
        REF,
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"t{port}",
                str(ROOT / "run_train.py"),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-3000:] for o in outs)
    assert [x["version"] for x in records(tmp_path)] == list(range(1, 7))


def test_one_and_two_trainer_ranks_take_the_same_gradient_on_the_same_batch():
    """The loss's trainer-count factor (FSDP averages gradients over ranks): gradients, not weights after AdamW,
    are compared, since Adam's normalisation would hide a wrong factor (a factor of 2 off: relative difference 0.5)."""
    from conftest import torchrun_script

    r = torchrun_script(2, ROOT / "tests" / "dist" / "dp_equivalence.py", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "DP_EQUIVALENCE_OK" in r.stdout
