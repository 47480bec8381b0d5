"""Trainer checkpoints: DCP (sharded, one file set per trainer rank) for model and optimizer, plus a JSON file
with the step, policy version, scheduler, RNG and data positions. `latest` names the newest complete one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:07d}"


def save_checkpoint(
    folder: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    meta: dict[str, Any],
    group: dist.ProcessGroup | None,
    is_main: bool,
    keep: int = 2,
) -> Path:
    """Collective over the trainer ranks. `meta` must be JSON-serialisable (version, data positions...)."""
    folder = Path(folder)
    path = _step_dir(folder, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=group)
    dist.barrier(group=group)
    if is_main:
        full_meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state().tolist(),
            **meta,
        }
        (path / "meta.json").write_text(json.dumps(full_meta))
        (folder / "latest.tmp").write_text(path.name)
        (folder / "latest.tmp").replace(folder / "latest")  # atomic: never points at a half-written step
        for old in sorted(folder.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return path


def latest_checkpoint(folder: str | Path) -> Path | None:
    pointer = Path(folder) / "latest"
    if not pointer.is_file():
        return None
    path = Path(folder) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG in place (collective); returns the meta dict."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = read_meta(path)
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta
