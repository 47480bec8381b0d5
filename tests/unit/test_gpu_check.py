"""scripts/gpu_check.py's runner: each part's limit cut to what is left of --budget-s, a part without time left
skipped, and the table of the parts so far written before each part starts."""

from __future__ import annotations

import json
import sys
import time

import pytest

from scripts.gpu_check import Runner

INFO = {"device": "cpu (test)", "python": "3", "torch": "2"}


def test_a_part_runs_with_its_own_limit_without_a_budget(tmp_path):
    run = Runner(tmp_path, {}, INFO, None)
    row = run("quick", [sys.executable, "-c", "print('hi')"], 30)
    assert row["status"] == "ok" and (tmp_path / "quick.log").read_text() == "hi\n"
    row = run("hangs", [sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert row["status"] == "hung (killed after 0 s)" and row["wall_s"] < 10


def test_the_budget_cuts_a_limit_and_skips_a_part_with_too_little_left(tmp_path):
    run = Runner(tmp_path, {}, INFO, time.monotonic() + 3.0, min_part_s=1.0)
    t = time.monotonic()
    row = run("cut", [sys.executable, "-c", "import time; time.sleep(60)"], 300)  # its own limit: 300 s
    assert row["status"].startswith("hung (killed after") and time.monotonic() - t < 10
    run.rows.append(row)
    skipped = run("late", [sys.executable, "-c", "print('never')"], 300)
    assert skipped["status"].startswith("skipped (budget") and not (tmp_path / "late.log").exists()
    # the table of the parts before was written when `late` was about to start
    assert [r["part"] for r in json.loads((tmp_path / "gpu_check.json").read_text())["parts"]] == ["cut"]
    assert "| cut | hung" in (tmp_path / "gpu_check.md").read_text()


def test_a_missing_wheel_stops_the_check_before_any_part_naming_the_fix(tmp_path, monkeypatch):
    """Without torchdata (the wheel `scripts/gpu_wheels.sh` fetches, which the device call must carry) every part
    that imports the job's code would fail at once: the check refuses to start, naming the package and the fix;
    the attention and startup parts do not need it."""
    import importlib.util

    import scripts.gpu_check as gc

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchdata" else real(name, *a))
    assert gc.missing_packages({"attention", "startup"}) == []
    assert gc.missing_packages({"attention", "rl_step"}) == ["torchdata"]
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu", "--out", str(tmp_path), "--parts", "rl_step"])
    with pytest.raises(SystemExit, match=r"torchdata not importable .* rl_step import: run `bash scripts/gpu_wheels"):
        gc.main()
    assert not (tmp_path / "gpu_check.md").exists()
