"""Run metrics: one JSON object per step in metrics.jsonl, TensorBoard events under tb/, a console line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes from one rank only (construct with enabled=False elsewhere)."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, enabled: bool = True,
                 prefix: str = "") -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.start = time.time()
        self._writer = None
        self._file = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._file = open(out / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(out / "tb"))

    def log(self, step: int, values: dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        record = {"step": step, "wall_time_s": round(time.time() - self.start, 3), **values}
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._writer.add_scalar(f"{self.prefix}{k}", v, step)
        if console:
            parts = [f"{k}={_fmt(v)}" for k, v in record.items()]
            print(f"[{self.prefix or 'train'}] " + " ".join(parts), flush=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
