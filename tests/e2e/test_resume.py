"""Checkpoints and resume of the PipelineRL job: the trainer restored exactly, the same next step, an error when a
required checkpoint is missing."""

from __future__ import annotations

import pytest
import torch
from jobs import REF, records, short_run

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_checkpoint_resume_restores_the_trainer_exactly(warm_folder, tmp_path):
    from safetensors.torch import load_file

    from pipelinerl_fsdp.checkpoint_layout import exported_policies

    ck = f"--checkpoint.folder={tmp_path}/ck"
    r = short_run(
        2,
        1,
        warm_folder,
        tmp_path / "a",
        ck,
        REF,
        "--rl.max_steps=4",
        "--checkpoint.interval=2",
        "--checkpoint.export_every=1",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-0000004"
    # the policy after every step, for offline evaluation: steps 1-3 under exports/, the 4th is final/
    exports = exported_policies(tmp_path / "a", 4)
    assert [s for s, _ in exports] == [1, 2, 3, 4] and exports[-1][1].name == "final"
    weights = [load_file(str(f / "model.safetensors")) for _, f in exports]
    for before, after in zip(weights, weights[1:]):  # each step moved the weights: no export is a stale copy
        assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all((f / "tokenizer.json").is_file() and (f / "config.json").is_file() for _, f in exports)
    # Resuming at the last step trains nothing: the exported policy must be the checkpoint's, bit for bit.
    r = short_run(2, 1, warm_folder, tmp_path / "b", ck, REF, "--rl.max_steps=4", "--checkpoint.resume=required")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stdout
    a = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    init = load_file(str(warm_folder / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # training did move the weights
    # Resuming with more steps continues the version count where it stopped.
    r = short_run(2, 1, warm_folder, tmp_path / "c", ck, REF, "--rl.max_steps=6", "--checkpoint.resume=required")
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x["version"] for x in records(tmp_path / "c")] == [5, 6]


def test_resume_without_checkpoint_is_an_error(warm_folder, tmp_path):
    r = short_run(
        2, 1, warm_folder, tmp_path, f"--checkpoint.folder={tmp_path}/none", "--checkpoint.resume=required", timeout=180
    )
    assert r.returncode != 0
    assert "checkpoint.resume = 'required' but" in r.stderr


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_resumed_trainer_takes_the_same_next_step(tmp_path, variant):
    """Model, optimizer and schedule restored from DCP: the next step's loss and resulting weights are identical
    to those of the uninterrupted trainer (on the same batch; pipeline data itself is timing-dependent). `lora`:
    the adapters on a bf16 frozen base, the checkpoint holding only the adapters and their optimizer state."""
    from conftest import torchrun_script

    args = [str(tmp_path)] + (["lora"] if variant == "lora" else [])
    r = torchrun_script(2, ROOT / "tests" / "dist" / "resume_exact.py", *args, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "RESUME_EXACT_OK" in r.stdout and f"lora={variant == 'lora'}" in r.stdout
