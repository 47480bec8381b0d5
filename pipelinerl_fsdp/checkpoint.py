"""Trainer checkpoints: DCP (sharded, one file set per trainer rank) for model and optimizer, plus a JSON file
with the step, policy version, scheduler, RNG and data positions.

A checkpoint is complete once its `meta.json` exists: it is written last (atomically, by rename), after every
rank's shards, and lists every file of the checkpoint with its size. A save that dies half-way leaves a folder
without `meta.json`, which is never resumed from; a folder whose files do not match the list (truncated, deleted)
is damaged and skipped for the previous one with a warning. `latest` names the newest complete one (for people;
resuming scans the folders)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pipelinerl_fsdp.config import Config, ConfigError, checkpoint_folder
from pipelinerl_fsdp.faults import maybe_fail


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
    if is_main and path.exists():  # left by an attempt that died while saving this step: start clean
        shutil.rmtree(path)
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=group)
    except (OSError, CheckpointException) as e:  # a full disk, a quota: nothing was deleted yet
        free = shutil.disk_usage(folder).free / 1e9
        raise OSError(
            f"saving checkpoint {path} failed ({write_failure(e)}; {free:.1f} GB free there); the previous complete "
            f"checkpoint in {folder} is intact, and this one is never resumed from"
        ) from e
    maybe_fail(dist.get_rank(), step, "save")
    dist.barrier(group=group)
    if is_main:
        full_meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state().tolist(),
            **meta,
            "files": {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()},
        }
        (path / "meta.json.tmp").write_text(json.dumps(full_meta))
        (path / "meta.json.tmp").replace(path / "meta.json")  # the completion mark
        (folder / "latest.tmp").write_text(path.name)
        (folder / "latest.tmp").replace(folder / "latest")  # atomic: never points at a half-written step
        for old in sorted(folder.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return path


def write_failure(e: BaseException) -> str:
    """What went wrong in a save, in one line: DCP wraps each rank's error (ENOSPC, EDQUOT...) in a
    `CheckpointException` whose own text is a multi-line traceback per rank."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded (incomplete, a file missing or of the wrong size), or None."""
    if not (path / "meta.json").is_file():
        return "incomplete (no meta.json: the save did not finish)"
    try:
        files = read_meta(path).get("files")
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    if files is None:  # written before file lists existed: DCP's own index is the check left
        return None if (path / ".metadata").is_file() else "DCP .metadata missing"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} expected"
    return None


def newest_intact(folder: str | Path) -> tuple[Path | None, list[str]]:
    """The newest loadable checkpoint in `folder` (None if there is none) and a warning per newer one skipped."""
    skipped = []
    for path in sorted(Path(folder).glob("step-*"), reverse=True):
        why = damage(path)
        if why is None:
            return path, skipped
        skipped.append(f"checkpoint {path} skipped: {why}")
    return None, skipped


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest loadable checkpoint in `folder`, or None."""
    return newest_intact(folder)[0]


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


def resume_point(cfg: Config) -> tuple[Path | None, list[str]]:
    """The checkpoint this job starts from (None: step 0) and warnings about damaged ones skipped on the way:
    `checkpoint.resume_from` when set, else with `checkpoint.resume` "auto" / "required" the newest intact one in
    the checkpoint folder. Every rank reaches the same answer from the same (shared) folder."""
    ck = cfg.checkpoint
    if ck.resume_from:
        path = Path(ck.resume_from)
        why = damage(path) if path.is_dir() else "no such folder"
        if why:
            raise ConfigError(f"checkpoint.resume_from = {ck.resume_from!r}: {why} ({cfg.source})")
        return path, []
    if ck.resume == "off":
        return None, []
    folder = checkpoint_folder(cfg)
    path, skipped = newest_intact(folder)
    if path is None and ck.resume == "required":
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise ConfigError(f"checkpoint.resume = 'required' but {folder} holds no intact checkpoint{detail}")
    return path, skipped


def export_folder(cfg: Config, step: int) -> Path:
    """Where `checkpoint.export_every` writes the policy (an HF folder) after `step` optimizer steps."""
    return Path(cfg.job.output_dir) / "exports" / f"step-{step:07d}"


def exported_policies(output_dir: str | Path, max_steps: int) -> list[tuple[int, Path]]:
    """(step, folder) of a run's exported policies in step order: `exports/step-N`, and `final/` as step
    `max_steps` when the run got that far."""
    output_dir = Path(output_dir)
    out = [(int(p.name.removeprefix("step-")), p) for p in (output_dir / "exports").glob("step-*") if p.is_dir()]
    if (output_dir / "final" / "config.json").is_file():
        out.append((max_steps, output_dir / "final"))
    return sorted(out)
