"""The colocated baseline (`python -m benchmarks.colocated`) learns on the job's step and metrics, with its generator on
the weights just trained: lag 0 and ESS 1 at every step, even at a learning rate that moves the policy a lot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT
from pipelinerl_fsdp.checkpoint_layout import exported_policies

pytestmark = pytest.mark.slow


def test_colocated_generates_with_the_weights_it_just_trained(default_warmstart, tmp_path):
    folder, _, r = default_warmstart
    assert r.returncode == 0, r.stderr[-3000:]
    steps = 6
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.colocated",
        "--config",
        "arithmetic",
        f"--warmstart.path={folder}",
        f"--job.output_dir={tmp_path}",
        f"--rl.max_steps={steps}",
        "--rl.batch_size=32",
        "--rl.attempts=4",
        # large steps: a generator left on older weights would show at once as ESS < 1
        "--trainer.optimizer.lr=3e-3",
        "--trainer.optimizer.warmup_steps=0",
        "--metrics.tensorboard=false",
        "--checkpoint.export_every=2",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, steps + 1))
    assert [x["samples"] for x in recs] == [32 * (i + 1) for i in range(steps)]
    # exported like the job's trainer (learning_speed.py evaluates these): steps 2 and 4, then final/ (step 6)
    exports = exported_policies(tmp_path, steps)
    assert [s for s, _ in exports] == [2, 4, 6] and exports[-1][1].name == "final"
    first, last = (load_file(str(f / "model.safetensors")) for f in (exports[0][1], exports[-1][1]))
    assert any(not torch.equal(first[k], last[k]) for k in first)
    for x in recs:
        assert x["lag_max"] == 0 and x["mixed_version_frac"] == 0
        assert x["ess"] > 0.999, x  # behaviour policy = trained policy
        # generation and training take turns: they never overlap
        assert x["trainer_busy_frac"] + x["inference_busy_frac"] < 1.02, x
    # ... and together they fill the steps. Per step a stall outside both (an export, the machine) can leave a gap:
    # one CI run had a step at 0.85 among steps at 0.98-0.99
    fill = sorted(x["trainer_busy_frac"] + x["inference_busy_frac"] for x in recs)
    assert fill[len(fill) // 2] > 0.95, fill
