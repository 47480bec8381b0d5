"""Soak of the tool sandbox: many calls, a fraction of them hostile, through `ToolMailbox(ToolRunner(...))` as the
engine's turn loop sends them; the answers of the clean calls checked, the rank's memory and file descriptors and
the machine's leftovers (processes, zombies, IPC objects, mounts) measured.

    python -m benchmarks.tool_sandbox_soak --calls 10000 --hostile 0.1 --out benchmarks/results/tool_sandbox_soak.json
    python -m benchmarks.tool_sandbox_soak --percall 20     # the cost of one call: median of 20, one at a time

Not a job: the calls go through the runner and mailbox the `tool_arithmetic` task uses, polled every 1 ms as the
engine loop polls between steps, without a model (the job's steps per second are not measured here).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import time
from pathlib import Path

from pipelinerl_fsdp.tools.leftovers import my_children, tool_pids
from pipelinerl_fsdp.tools.sandbox import TOOL_OUTCOMES, ToolLimits, ToolMailbox, ToolRunner

HOSTILE = {
    "hang": "while True:\n    pass",
    "sleep_tree": "import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(60)",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory_bomb": "x = bytearray(2 * 1024**3)",
    "flood": "print('x' * 1_000_000)",
    "realtime_signal": "import os\nos.kill(os.getpid(), 40)",
    "sigkill_self": "import os\nos.kill(os.getpid(), 9)",
    "segfault": "import ctypes\nctypes.string_at(0)",
    "unlisted_syscall": "import ctypes\nctypes.CDLL(None).syscall(312, 0, 0, 0, 0, 0)",
    "detached_child": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left')",
    "shm_fill": (
        "import ctypes\nl = ctypes.CDLL(None)\nfor _ in range(64):\n"
        "    i = l.shmget(0, 1 << 20, 0o1600)\n    i >= 0 and l.shmat(i, None, 0)\nwhile True:\n    pass"
    ),
    "file_bomb": "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 1000)\n    i += 1",
    "exit_weird": "import os\nos._exit(77)",
}


def memory() -> dict[str, float]:
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    rss = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x[:6] == "VmRSS:")
    shm = info.get("Shmem", 0)
    return {
        "available_mib": info["MemAvailable"] / 1024,
        "shmem_mib": shm / 1024,
        "rank_rss_mib": rss / 1024,
        "rank_fds": len(os.listdir("/proc/self/fd")),
    }


def percall(n: int) -> dict:
    """One call at a time, polled every 1 ms: the median wall time from submit to result."""
    runner = ToolRunner(ToolLimits(timeout_s=5), workers=1)
    box, times = ToolMailbox(runner), []
    for i in range(n + 1):
        t0 = time.perf_counter()
        box.submit(i, "print(2 + 2)")
        while (r := box.take(i)) is None:
            time.sleep(0.001)
        assert r.outcome == "ok" and r.output == "4\n", r
        times.append(time.perf_counter() - t0)
    runner.close()
    return {"calls": n, "median_ms": statistics.median(times[1:]) * 1e3, "min_ms": min(times[1:]) * 1e3}


def soak(calls: int, hostile: float, workers: int, seed: int) -> dict:
    libc = ctypes.CDLL(None)
    libc.prctl(36, 1, 0, 0, 0)  # child subreaper: anything a call orphans comes here, where it is counted
    rng = random.Random(seed)
    limits = ToolLimits(timeout_s=0.5, memory_mb=256, max_output_bytes=4096, ipc_kb=1024)
    runner = ToolRunner(limits, workers=workers)
    box = ToolMailbox(runner)
    ipc = [Path(f"/proc/sysvipc/{k}").read_text() for k in ("shm", "msg", "sem")]
    mounts, before = Path("/proc/self/mountinfo").read_text(), tool_pids()
    samples = [{"calls": 0, **memory()}]
    outcomes = {o: 0 for o in TOOL_OUTCOMES}
    by_kind: dict[str, dict[str, int]] = {}
    wrong, t0 = 0, time.monotonic()
    pending: dict[int, tuple[str, str]] = {}
    submitted = done = 0
    while done < calls:
        while submitted < calls and len(pending) < 2 * workers:
            if rng.random() < hostile:
                kind = rng.choice(sorted(HOSTILE))
                code, want = HOSTILE[kind], ""
            else:
                terms = [rng.randint(10, 99) for _ in range(rng.randint(2, 8))]
                kind, code, want = "clean", f"print({'+'.join(map(str, terms))})", f"{sum(terms)}\n"
            box.submit(submitted, code)
            pending[submitted] = (kind, want)
            submitted += 1
        for cid in list(pending):
            r = box.take(cid)
            if r is None:
                continue
            kind, want = pending.pop(cid)
            outcomes[r.outcome] += 1
            by_kind.setdefault(kind, {}).setdefault(r.outcome, 0)
            by_kind[kind][r.outcome] += 1
            wrong += kind == "clean" and (r.outcome != "ok" or r.output != want)
            done += 1
            if done % 1000 == 0:
                samples.append({"calls": done, **memory()})
                print(f"{done} calls, {time.monotonic() - t0:.0f} s: {samples[-1]}", flush=True)
        time.sleep(0.001)
    runner.close()
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while (tool_pids() - before or my_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {"tool_processes": len(tool_pids() - before), "children_incl_zombies": len(my_children())}
    left["ipc_objects_changed"] = ipc != [Path(f"/proc/sysvipc/{k}").read_text() for k in ("shm", "msg", "sem")]
    left["mounts_changed"] = mounts != Path("/proc/self/mountinfo").read_text()
    rss = [s["rank_rss_mib"] for s in samples]
    return {
        "calls": calls,
        "hostile_fraction": hostile,
        "workers": workers,
        "wall_s": wall,
        "calls_per_s": calls / wall,
        "outcomes": outcomes,
        "by_kind": by_kind,
        "clean_answers_wrong": wrong,
        "leftovers": left,
        "memory_samples": samples,
        "rank_rss_growth_mib": rss[-1] - rss[1] if len(rss) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--hostile", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--percall", type=int, default=0, help="only measure the cost of one call (median of N)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    result = {"percall": percall(a.percall or 20)}
    print(json.dumps(result["percall"]), flush=True)
    if not a.percall:
        result["soak"] = soak(a.calls, a.hostile, a.workers, a.seed)
        print(json.dumps({k: v for k, v in result["soak"].items() if k != "memory_samples"}, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
