"""Which checkpoint a (re)started job resumes from: the newest intact one; an unfinished save (no meta.json) or a
damaged one (a file missing or truncated) is skipped with a reason; metrics after the resumed step are dropped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipelinerl_fsdp.checkpoint_layout import damage, newest_intact, resume_point
from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.config.lora import LoRAConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.training.checkpoint import lora_resume_problem
from pipelinerl_fsdp.training.metrics import MetricsLogger


def _ck(cfg):
    """`resume_point`'s arguments: the checkpoint section and the job's output folder."""
    return cfg.checkpoint, cfg.job.output_dir


def fake_checkpoint(folder: Path, step: int, complete: bool = True) -> Path:
    path = folder / f"step-{step:07d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    if complete:
        files = {".metadata": 10, "__0_0.distcp": 100}
        (path / "meta.json").write_text(json.dumps({"step": step, "files": files}))
    return path


def test_newest_intact_skips_unfinished_and_damaged(tmp_path):
    fake_checkpoint(tmp_path, 4)
    truncated = fake_checkpoint(tmp_path, 8)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 60)
    fake_checkpoint(tmp_path, 12, complete=False)  # killed while saving
    path, skipped = newest_intact(tmp_path)
    assert path == tmp_path / "step-0000004"
    assert "step-0000012 skipped: incomplete" in skipped[0]
    assert "step-0000008 skipped: __0_0.distcp has 60 bytes, 100 expected" in skipped[1]
    (tmp_path / "step-0000004" / ".metadata").unlink()
    assert damage(tmp_path / "step-0000004") == ".metadata missing"
    assert newest_intact(tmp_path)[0] is None


def test_resume_modes(tmp_path):
    base = ["--config", "arithmetic", f"--checkpoint.folder={tmp_path}"]
    assert resume_point(*_ck(load_config(base))) == (None, [])  # auto, nothing there: a fresh start
    with pytest.raises(ConfigError, match="checkpoint.resume = 'required' but .* holds no intact checkpoint"):
        resume_point(*_ck(load_config([*base, "--checkpoint.resume=required"])))
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 8)
    assert resume_point(*_ck(load_config(base)))[0] == tmp_path / "step-0000008"
    assert resume_point(*_ck(load_config([*base, "--checkpoint.resume=off"])))[0] is None
    chosen = resume_point(*_ck(load_config([*base, f"--checkpoint.resume_from={tmp_path}/step-0000004"])))
    assert chosen[0] == tmp_path / "step-0000004"
    with pytest.raises(ConfigError, match="checkpoint.resume_from = .*step-0000009.*: no such folder"):
        resume_point(*_ck(load_config([*base, f"--checkpoint.resume_from={tmp_path}/step-0000009"])))


def test_a_resumed_logger_drops_the_failed_attempts_later_steps(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=10)
    for step in range(1, 7):
        log.log(step, {"x": step}, console=False)
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "x"')  # the line the killed process was writing
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=10, resume_step=4)
    for step in range(5, 7):
        log.log(step, {"x": step}, console=False)
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


FULL_DISK_SAVE = """
import resource, signal, sys
import torch, torch.distributed as dist
from pipelinerl_fsdp.training.checkpoint import save_checkpoint


folder = sys.argv[1]
# a file rendezvous: no port to race for with anything else on the machine
dist.init_process_group("gloo", init_method=f"file://{folder}/.rendezvous", rank=0, world_size=1)
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
save_checkpoint(folder, 4, model, opt, sched, {"version": 4}, None, True)
# From here on every write past 100 kB fails (EFBIG, as ENOSPC would on a full disk) instead of killing us
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
save_checkpoint(folder, 8, model, opt, sched, {"version": 8}, None, True)
"""


def test_a_save_that_cannot_write_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    """A real failed write in the middle of a save (a file-size limit: the kernel refuses the write as it would on a
    full disk): DCP's multi-line wrapped error becomes one that names the checkpoint and says the previous one is
    intact, and the previous one is what a restart resumes from."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SAVE, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert "OSError: saving checkpoint" in last and str(tmp_path / "step-0000008") in last, r.stderr[-2000:]
    assert f"the previous complete checkpoint in {tmp_path} is intact" in last and "rank 0:" in last, last
    path, skipped = newest_intact(tmp_path)
    assert path == tmp_path / "step-0000004" and damage(path) is None
    assert skipped == [
        f"checkpoint {tmp_path / 'step-0000008'} skipped: incomplete (no meta.json: the save did not finish)"
    ]


def test_a_lora_resume_needs_the_same_adapters_and_nothing_else_of_the_section():
    saved = dataclasses.asdict(LoRAConfig(enabled=True, rank=16))  # meta.json keeps the whole section
    # what does not change the saved adapters may change between attempts
    assert lora_resume_problem(saved, LoRAConfig(enabled=True, rank=16, dropout=0.1, export_merged=True)) is None
    assert lora_resume_problem(saved, LoRAConfig(enabled=True, rank=16, engine_base="host")) is None
    assert lora_resume_problem(None, None) is None
    # what does: shapes, names, the function the adapters compute
    for other in (
        LoRAConfig(enabled=True, rank=8),
        LoRAConfig(enabled=True, rank=16, alpha=16.0),
        LoRAConfig(enabled=True, rank=16, use_rslora=True),
        LoRAConfig(enabled=True, rank=16, target_modules=["q_proj", "v_proj"]),
    ):
        problem = lora_resume_problem(saved, other)
        assert problem is not None and "'rank': 16" in problem and "resume with the adapters" in problem
    assert "[lora] off" in lora_resume_problem(saved, None)
    assert "saved with [lora] off" in lora_resume_problem(None, LoRAConfig(enabled=True))
    # the same targets listed in another order are the same adapters (the layout follows the model)
    shuffled = LoRAConfig(enabled=True, rank=16, target_modules=list(reversed(saved["target_modules"])))
    assert lora_resume_problem(saved, shuffled) is None
    # and the base they adapt must be the same weights (a checkpoint from before the hash was recorded: unchecked)
    now = LoRAConfig(enabled=True, rank=16)
    assert lora_resume_problem(saved, now, "aaaa", "aaaa") is None
    assert lora_resume_problem(saved, now, None, "bbbb") is None
    problem = lora_resume_problem(saved, now, "aaaa", "bbbb")
    assert problem is not None and "hash to aaaa" in problem and "hashes to bbbb" in problem


def test_a_weights_fingerprint_follows_the_weights_not_the_folder(tmp_path):
    from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
    from pipelinerl_fsdp.models.hf_io import weights_fingerprint

    args = flavour_args("debug-llama", vocab_size=32, num_hidden_layers=2)
    save_hf_folder(tmp_path / "a", args, build_model(args, seed=0).state_dict())
    save_hf_folder(tmp_path / "b", args, build_model(args, seed=1).state_dict())  # same shapes, other values
    first = weights_fingerprint(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "moved")
    assert weights_fingerprint(tmp_path / "moved") == first
    assert weights_fingerprint(tmp_path / "b") != first
    # one tensor changed past the header (a base and the same base with one linear merged): another hash
    state = build_model(args, seed=0).state_dict()
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] + 1.0
    save_hf_folder(tmp_path / "c", args, state)
    assert weights_fingerprint(tmp_path / "c", head_bytes=1024) != weights_fingerprint(tmp_path / "moved", 1024)
