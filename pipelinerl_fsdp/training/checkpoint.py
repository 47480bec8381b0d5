"""Trainer checkpoints: DCP (sharded, one file set per trainer rank) for model and optimizer, plus a JSON file
with the step, policy version, scheduler, RNG and data positions.

A checkpoint is complete once its `meta.json` exists: it is written last (atomically, by rename), after every
rank's shards, and lists every file of the checkpoint with its size. A save that dies half-way leaves a folder
without `meta.json`, which is never resumed from; a folder whose files do not match the list (truncated, deleted)
is damaged and skipped for the previous one with a warning. `latest` names the newest complete one (for people;
resuming scans the folders)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pipelinerl_fsdp.checkpoint_layout import read_meta, step_dir
from pipelinerl_fsdp.config.lora import TRAINED_STATE_KEYS, LoRAConfig
from pipelinerl_fsdp.models.hf_io import weights_fingerprint
from pipelinerl_fsdp.runtime.faults import maybe_fail
from pipelinerl_fsdp.training.policy import Policy


def state_options(model: torch.nn.Module) -> StateDictOptions:
    """What a checkpoint holds of the model: the parameters that train. Under LoRA that is the adapters (and the
    optimizer's state of them), a few MB; the frozen base is re-read from `model.path` on resume."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


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
    path = step_dir(folder, step)
    if is_main and path.exists():  # left by an attempt that died while saving this step: start clean
        shutil.rmtree(path)
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_options(model))
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
            # the adapters' shape and scaling (None: full weights): a resume under another [lora] is refused
            "lora": dataclasses.asdict(lora) if (lora := getattr(model, "lora", None)) is not None else None,
            # under LoRA only the adapters are saved: the base they were trained on is named by its weights' hash
            "lora_base": base_fingerprint(model),
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


def base_fingerprint(model: torch.nn.Module) -> str | None:
    """Under LoRA, the hash of the HF folder the frozen base was loaded from (`training.policy.load_sharded`
    records it; `hf_io.weights_fingerprint`); None for full weights, which the checkpoint holds itself."""
    folder = getattr(model, "base_folder", None)
    return weights_fingerprint(folder) if folder is not None else None


def lora_resume_problem(
    saved: dict[str, Any] | None,
    now: LoRAConfig | None,
    saved_base: str | None = None,
    now_base: str | None = None,
) -> str | None:
    """Why a checkpoint saved under `saved` (meta.json's "lora": the whole [lora] section, or None for full
    weights) cannot resume a job with `now`, or None where it can: the adapters' defining keys must match
    (`LoRAConfig.trained_state`; the rest of the section may change between attempts), and so must the base they
    adapt (`saved_base`, `now_base`: `base_fingerprint`s; a checkpoint that recorded none is not checked)."""
    was = {k: saved.get(k) for k in TRAINED_STATE_KEYS} if saved is not None else None
    if was is not None:
        was["target_modules"] = sorted(was["target_modules"])
    is_ = now.trained_state() if now is not None else None
    if was != is_:
        return (
            f"saved with [lora] {was or 'off'}, this job has [lora] {is_ or 'off'}: resume with the adapters it was "
            "saved with"
        )
    if saved_base is not None and now_base is not None and saved_base != now_base:
        return (
            f"its adapters were trained on a base whose weights hash to {saved_base}; this job's model folder "
            f"hashes to {now_base} (another model, or a warm start trained again): resume with the base they adapt"
        )
    return None


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG in place (collective); returns the meta dict."""
    meta = read_meta(path)
    saved_base = meta.get("lora_base")
    now_base = base_fingerprint(model) if saved_base is not None else None
    problem = lora_resume_problem(meta.get("lora"), getattr(model, "lora", None), saved_base, now_base)
    if problem:  # DCP would fail on the keys, or worse load adapters of another shape's name
        raise ValueError(f"checkpoint {path}: {problem}")
    options = state_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta


@dataclass
class Checkpointer:
    """The RL trainer's checkpoints of `policy` in `folder` (`checkpoint.folder`), the newest `keep` kept; every
    method is collective over the trainer ranks (`group`)."""

    folder: Path
    keep: int
    policy: Policy
    group: dist.ProcessGroup | None
    is_main: bool

    def save(self, step: int, meta: dict[str, Any]) -> Path:
        """Save after `step` optimizer steps; `meta` (JSON) goes into meta.json beside the step and schedule."""
        p = self.policy
        return save_checkpoint(
            self.folder, step, p.model, p.optimizer, p.scheduler, meta, self.group, self.is_main, self.keep
        )

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the policy (model, optimizer, schedule) and the RNG from `path`; returns its meta dict."""
        p = self.policy
        return load_checkpoint(path, p.model, p.optimizer, p.scheduler, self.group)
