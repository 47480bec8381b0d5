"""The checkpoint folder's layout, read by every role: which checkpoints are complete and intact, where a job
resumes from, what its meta.json says, where policies are exported. No torch: the inference ranks read it too
(the resume position of their prompt streams). Saving and loading the tensors is `checkpoint.py`'s (trainers).

A checkpoint is complete once its `meta.json` exists (written last, by rename) and lists every file with its
size; a folder whose files do not match the list is damaged and skipped for the previous one with a warning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelinerl_fsdp.config import CheckpointConfig, ConfigError


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:07d}"


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


def resume_point(ck: CheckpointConfig, output_dir: str) -> tuple[Path | None, list[str]]:
    """The checkpoint this job starts from (None: step 0) and warnings about damaged ones skipped on the way:
    `checkpoint.resume_from` when set, else with `checkpoint.resume` "auto" / "required" the newest intact one in
    the checkpoint folder. Every rank reaches the same answer from the same (shared) folder."""
    if ck.resume_from:
        path = Path(ck.resume_from)
        why = damage(path) if path.is_dir() else "no such folder"
        if why:
            raise ConfigError(f"checkpoint.resume_from = {ck.resume_from!r}: {why}")
        return path, []
    if ck.resume == "off":
        return None, []
    folder = ck.folder_under(output_dir)
    path, skipped = newest_intact(folder)
    if path is None and ck.resume == "required":
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise ConfigError(f"checkpoint.resume = 'required' but {folder} holds no intact checkpoint{detail}")
    return path, skipped


def export_folder(output_dir: str | Path, step: int) -> Path:
    """Where `checkpoint.export_every` writes the policy (an HF folder) after `step` optimizer steps, in the run's
    `job.output_dir`."""
    return Path(output_dir) / "exports" / f"step-{step:07d}"


def exported_policies(output_dir: str | Path, max_steps: int) -> list[tuple[int, Path]]:
    """(step, folder) of a run's exported policies in step order: `exports/step-N`, and `final/` as step
    `max_steps` when the run got that far (an HF folder, or a LoRA run's adapter folder: evaluate either through
    `models.peft_io.loadable_policy`)."""
    output_dir = Path(output_dir)
    out = [(int(p.name.removeprefix("step-")), p) for p in (output_dir / "exports").glob("step-*") if p.is_dir()]
    final = output_dir / "final"
    if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
        out.append((max_steps, output_dir / "final"))
    return sorted(out)
