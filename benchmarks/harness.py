"""What every benchmark shares: launching a training job under torchrun (the job's own entry point, this machine's
Python, the command line the tests use: `pipelinerl_fsdp.runtime.torchrun`), reading its metrics, and reporting: a
markdown table on the console and, under `benchmarks/results/` (next to the repository, wherever the benchmark is
started from), the same table as `.md` and everything as `.json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipelinerl_fsdp.runtime.torchrun import REPO as ROOT
from pipelinerl_fsdp.runtime.torchrun import job_command

RESULTS = ROOT / "benchmarks" / "results"


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats to 4 significant digits (whole numbers from 1000 on), the rest as they print."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def invocation() -> list[str]:
    """This process's command line after the interpreter: `-m benchmarks.NAME ARGS` when started as a module (its
    argv[0] is then the module's file), else argv."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return list(sys.argv)


def report(out: Path, title: str, columns: list[str], rows: list[list[Any]], data: dict[str, Any]) -> None:
    """Print the table; write `out` (JSON: `data`, the table and the command) and `out` with `.md` (the title, the
    command, the table)."""
    table = markdown_table(columns, rows)
    print(table, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *invocation()])
    out.write_text(json.dumps({**data, "command": command, "table": {"columns": columns, "rows": rows}}, indent=1))
    out.with_suffix(".md").write_text(f"# {title}\n\n`{command}`\n\n{table}\n")
    print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)


def run_job(args: list[str], log: Path, nproc: int) -> None:
    """Run the job (`run_train.py ARGS` on `nproc` ranks, one thread each), output to `log`; exits with the log's
    tail when the job fails."""
    run_logged(*job_command(nproc, *args), log)


def run_logged(cmd: list[str], env: dict[str, str], log: Path) -> None:
    """Run `cmd` in the repository root, output to `log`; exits with the log's tail when it fails."""
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"run failed ({' '.join(cmd)}); log {log}:\n{tail}")


def pyplot() -> Any:
    """matplotlib's pyplot on a file-only backend, or None (with a line saying so) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot written", flush=True)
        return None
    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Grid and legend on every panel that has data, then the figure to `path` (PNG)."""
    for ax in fig.axes:
        if ax.has_data():
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_metrics(path: Path) -> list[dict]:
    """The records of a job's metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
