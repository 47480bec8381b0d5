"""Run metrics: one JSON object per step in metrics.jsonl, one per completed evaluation in evals.jsonl, TensorBoard
events under tb/, a console line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

# (metric key, console label, format) of the console line; keys missing from a step are left out.
ConsoleFields = list[tuple[str, str, str]]
RL_CONSOLE: ConsoleFields = [
    ("reward_mean", "reward", "{:.3f}"),
    ("ess", "ess", "{:.3f}"),
    ("lag_mean", "lag", "{:.2f}"),
    ("lag_max", "max", "{:d}"),
    ("update_pause_ms", "pause", "{:.0f} ms"),
    ("trainer_busy_frac", "busy", "{:.2f}"),
    ("dropped_stale", "dropped", "{:d}"),
]
WARMSTART_CONSOLE: ConsoleFields = [
    ("loss", "loss", "{:.4f}"),
    ("eval_accuracy", "eval", "{:.3f}"),
    ("train_tokens_per_s", "tok/s", "{:.0f}"),
]


def rl_console(eval_set: str | None) -> ConsoleFields:
    """The RL console fields, with the first evaluation set's pass@1 (when there is one) after the reward."""
    fields = list(RL_CONSOLE)
    if eval_set:
        fields.insert(1, (f"eval/{eval_set}/pass@1", "eval", "{:.3f}"))
    return fields


def format_duration(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def console_line(
    stage: str,
    step: int,
    total: int,
    elapsed_s: float,
    values: dict[str, Any],
    fields: ConsoleFields,
    eta_s: float = float("nan"),
) -> str:
    """`[rl] step 20/300 | 0:35, ETA 4:50 | reward 0.612 | ...`: progress, elapsed, ETA, then the key metrics."""
    parts = [
        f"[{stage}] step {step}/{total}",
        f"{format_duration(elapsed_s)}, ETA {format_duration(eta_s) if math.isfinite(eta_s) else '?'}",
    ]
    for key, label, fmt in fields:
        v = values.get(key)
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            continue
        parts.append(f"{label} {fmt.format(int(v) if fmt.endswith('d}') else v)}")
    return " | ".join(parts)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:  # a line cut off by the crash
        return 1 << 62


class MetricsLogger:
    """Writes from one rank only (construct with enabled=False elsewhere)."""

    def __init__(
        self,
        output_dir: str | Path,
        tensorboard: bool = True,
        enabled: bool = True,
        prefix: str = "",
        total_steps: int = 0,
        console_fields: ConsoleFields | None = None,
        resume_step: int = 0,
    ) -> None:
        """Records after `resume_step` already in the folder are dropped from metrics.jsonl, evals.jsonl and
        TensorBoard, so that the run logs every step once: in a resumed run those of the attempt that stopped; in
        a fresh run (`resume_step` 0) those of an earlier run in the same folder, which appending would mix with
        this run's (its steps counted twice, its wall times jumping back)."""
        self.enabled = enabled
        self.prefix = prefix
        self.total_steps = total_steps
        # the ETA extrapolates from the first step this process logged on (which includes start-up waits)
        self._eta_from: tuple[int, float] | None = None
        self.console_fields = console_fields or []
        self.start = time.time()
        self._writer = None
        self._file = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "evals.jsonl"):
            path = out / name
            if path.exists():
                lines = path.read_text().splitlines()
                kept = [line for line in lines if _step_of(line) <= resume_step]
                path.write_text("".join(line + "\n" for line in kept))
                if resume_step == 0 and lines and name == "metrics.jsonl":
                    print(
                        f"[{prefix.strip('/') or 'metrics'}] {path}: {len(lines)} records of an earlier run in this "
                        "folder replaced (a fresh run)",
                        flush=True,
                    )
        self._file = open(out / "metrics.jsonl", "a", buffering=1)
        self._evals_path = out / "evals.jsonl"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1  # events at later steps (an earlier attempt's or run's) are hidden
            self._writer = SummaryWriter(log_dir=str(out / "tb"), purge_step=purge)

    def log(self, step: int, values: dict[str, Any], console: bool = True, evals: list[dict[str, float]] = ()) -> None:
        """One step's record. `evals`: the evaluations completed since the last record, oldest first (each one
        set's `eval/<set>/...` metrics of one version); each gets a line in evals.jsonl and its points in
        TensorBoard, and the step's record (and console line) carries the newest of each set."""
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        newest: dict[str, float] = {}
        for e in evals:
            newest.update(e)  # a set's later version replaces its earlier one
        values = {**values, **newest}
        record = {"step": step, "wall_time_s": round(elapsed, 3), **values}
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if evals:
            with open(self._evals_path, "a") as f:
                f.writelines(json.dumps({"step": step, "wall_time_s": round(elapsed, 3), **e}) + "\n" for e in evals)
        if self._writer is not None:
            for group in [{k: v for k, v in values.items() if k not in newest}, *evals]:
                for k, v in group.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        self._writer.add_scalar(f"{self.prefix}{k}", v, step)
        eta = float("nan")
        if self._eta_from is None:
            self._eta_from = (step, elapsed)
        elif step > self._eta_from[0]:
            rate = (elapsed - self._eta_from[1]) / (step - self._eta_from[0])
            eta = rate * (self.total_steps - step)
        if console:
            stage = self.prefix.rstrip("/") or "rl"
            print(console_line(stage, step, self.total_steps, elapsed, values, self.console_fields, eta), flush=True)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Text (markdown) in TensorBoard's text tab."""
        if self._writer is not None:
            self._writer.add_text(f"{self.prefix}{tag}", text, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
