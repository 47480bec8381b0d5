"""The benchmarks' shared reporting (benchmarks/harness.py): the printed table is the one written, with its data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_prints_and_writes_the_same_table(tmp_path, capsys):
    h = harness()
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
