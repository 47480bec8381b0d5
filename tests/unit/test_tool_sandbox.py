"""Tool calls that cannot hurt the run: each fault gives its named outcome within its deadline, while the caller's
loop (standing in for an engine's decode loop) is never blocked."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from pipelinerl_fsdp.tools.sandbox import TOOL_OUTCOMES, ToolLimits, ToolResult, ToolRunner, network_isolation_available

LIMITS = ToolLimits(timeout_s=2.0, memory_mb=256, max_output_bytes=4096)


def run_all(runner: ToolRunner, calls: dict[str, str], budget_s: float = 30.0) -> tuple[dict[str, ToolResult], float]:
    """Submit `calls`, poll until all ended; returns the results and the longest single `poll`."""
    for call_id, code in calls.items():
        runner.submit(call_id, code)
    results: dict[str, ToolResult] = {}
    longest, deadline = 0.0, time.monotonic() + budget_s
    while runner.pending():
        assert time.monotonic() < deadline, f"tools still pending: {runner.pending()}"
        t0 = time.perf_counter()
        for r in runner.poll():
            results[r.call_id] = r
        longest = max(longest, time.perf_counter() - t0)
        time.sleep(0.005)  # the decode step the loop would run here
    return results, longest


def test_an_ordinary_call_prints_its_answer():
    runner = ToolRunner(LIMITS)
    res, _ = run_all(runner, {"sum": "print(sum(range(1, 101)))"})
    assert res["sum"].outcome == "ok" and res["sum"].output == "5050\n"


def test_each_fault_gives_its_outcome_within_its_deadline_and_never_blocks_the_loop():
    runner = ToolRunner(LIMITS, workers=3)
    calls = {
        "hang": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(60)",
        "raise": "1 / 0",
        "crash": "import os\nos.abort()",
        "memory": "x = bytearray(2 * 1024**3)",
        "flood": "print('x' * 10_000_000)",
        "ok": "print(6 * 7)",
    }
    t0 = time.monotonic()
    res, longest = run_all(runner, calls)
    wall = time.monotonic() - t0
    assert {k: r.outcome for k, r in res.items()} == {
        "hang": "tool_timeout",
        "sleep": "tool_timeout",
        "raise": "tool_error",
        "crash": "tool_error",
        "memory": "tool_error",
        "flood": "tool_output_truncated",
        "ok": "ok",
    }
    assert {r.outcome for r in res.values()} <= set(TOOL_OUTCOMES)
    assert "ZeroDivisionError" in res["raise"].output and "SIGABRT" in res["crash"].output
    assert "MemoryError" in res["memory"].output
    assert res["flood"].output == "x" * LIMITS.max_output_bytes  # the first bytes, exactly the cap
    assert res["ok"].output == "42\n"
    for k in ("hang", "sleep"):  # killed at the deadline, not long after
        assert LIMITS.timeout_s <= res[k].seconds < LIMITS.timeout_s + 1.0, (k, res[k].seconds)
    # never waits on a tool: the longest poll is far below any deadline (measured: a few ms)
    assert longest < 0.5, longest
    assert wall < 3 * (LIMITS.timeout_s + 1.0)  # 7 calls, 3 at a time, two of them hanging to their deadline


def test_no_writes_outside_the_scratch_folder_and_no_network(tmp_path: Path):
    outside = tmp_path / "outside.txt"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    runner = ToolRunner(LIMITS, scratch_root=str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    calls = {
        "write_outside": f"open({str(outside)!r}, 'w').write('x')",
        "remove_outside": f"import os\nos.remove({str(tmp_path)!r})",
        "escape_by_dots": "open('../escaped.txt', 'w').write('x')",
        "write_inside": "open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "process": "import subprocess\nsubprocess.run(['true'])",
        "ctypes": "import ctypes\nctypes.CDLL(None).getpid()",
        "limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    }
    try:
        res, _ = run_all(runner, calls)
    finally:
        server.close()
    assert res["write_inside"].outcome == "ok" and res["write_inside"].output == "kept\n"
    for k in ("write_outside", "remove_outside", "escape_by_dots", "network", "process", "ctypes", "limits"):
        assert res[k].outcome == "tool_error" and "tool sandbox" in res[k].output, (k, res[k].output)
    assert not outside.exists() and not (tmp_path / "escaped.txt").exists()
    assert list((tmp_path / "scratch").iterdir()) == []  # every call's folder removed


def test_a_file_larger_than_the_cap_cannot_be_written():
    runner = ToolRunner(LIMITS)
    res, _ = run_all(runner, {"big": "open('big.bin', 'wb').write(b'x' * 100_000)"})
    assert res["big"].outcome == "tool_error"  # SIGXFSZ or the OSError it raises


def test_close_kills_what_runs_and_the_worker_count_is_checked():
    runner = ToolRunner(LIMITS)
    runner.submit("sleep", "import time\ntime.sleep(60)")
    runner.poll()
    pid = runner._running[0].proc.pid
    runner.close()
    assert runner.pending() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ValueError, match="workers"):
        ToolRunner(LIMITS, workers=0)


def test_a_network_namespace_of_its_own_where_the_kernel_allows_one():
    """Behind the audit hook, the process has no interface but loopback (when a namespace is possible here: as
    root, or with unprivileged user namespaces; sessions here run as root)."""
    if not network_isolation_available():
        pytest.skip("no network namespace for an unprivileged process on this kernel")
    # /proc/self/net/dev lists the interfaces of the reading process's network namespace
    code = "print(sorted(line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]))"
    res, _ = run_all(ToolRunner(LIMITS), {"ifaces": code})
    assert res["ifaces"].outcome == "ok" and res["ifaces"].output == "['lo']\n", res["ifaces"].output
    with open("/proc/self/net/dev") as f:  # the test's own process does have more
        assert len(f.readlines()[2:]) > 1
