"""`benchmarks/` is a package run from the repository root (`python -m benchmarks.NAME`): no module of it edits
`sys.path` to find its neighbours or the project, and its README gives every benchmark's command in that form."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def test_no_module_under_benchmarks_edits_sys_path():
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted(BENCHMARKS.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)\b", line)
    ]
    assert not offenders, f"sys.path edited (import through the package instead): {offenders}"


def test_the_readme_starts_every_benchmark_as_a_module():
    readme = (BENCHMARKS / "README.md").read_text()
    runnable = [p.stem for p in sorted(BENCHMARKS.glob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]
    assert "learning_speed" in runnable and "harness" not in runnable
    missing = [name for name in runnable if f"-m benchmarks.{name}" not in readme]
    assert not missing, f"benchmarks/README.md gives no `python -m benchmarks.NAME` command for {missing}"
    assert not re.search(r"python (\S*/)?benchmarks/\w+\.py", readme), "a benchmark started by its path"
