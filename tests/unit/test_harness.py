"""The benchmarks' shared reporting (benchmarks/harness.py): the printed table is the one written, with its data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness as h

ROOT = Path(__file__).resolve().parents[2]


def test_report_prints_and_writes_the_same_table(tmp_path, capsys):
    out = tmp_path / "deep" / "bench.json"
    h.report(out, "A bench", ["engine", "tokens/s"], [["vllm", 1234.5678], ["reference", 99]], {"rows": [1, 2]})
    printed = capsys.readouterr().out
    table = "| engine | tokens/s |\n|---|---|\n| vllm | 1235 |\n| reference | 99 |"
    assert table in printed
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# A bench\n") and table in md
    data = json.loads(out.read_text())
    assert data["rows"] == [1, 2] and data["table"]["rows"] == [["vllm", 1234.5678], ["reference", 99]]
    assert "command" in data and h.RESULTS == ROOT / "benchmarks" / "results"


def test_the_command_written_is_the_module_a_benchmark_was_started_as(monkeypatch):
    """`python -m benchmarks.NAME ARGS` gives argv[0] as the module's file: the command written names the module."""
    monkeypatch.setattr(sys, "argv", ["/repo/benchmarks/rewards.py", "--workers", "1"])
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=SimpleNamespace(name="benchmarks.rewards")))
    assert h.invocation() == ["-m", "benchmarks.rewards", "--workers", "1"]
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))  # started as a script
    assert h.invocation() == ["/repo/benchmarks/rewards.py", "--workers", "1"]
