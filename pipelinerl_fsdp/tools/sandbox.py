"""Tool calls that cannot hurt the run: Python snippets (a calculator, a short program) run off the decode loop, each
inside an operating-system boundary of its own (tools/jail.py) with a deadline and a cap on output bytes.

`ToolRunner.submit` queues a call and returns at once; `poll` starts queued calls while fewer than `workers` run,
reads what the running ones printed, and returns the calls that ended, without ever waiting: an inference loop
calls it between two engine steps, as it does the reward pool, so a tool that hangs, crashes, eats memory or prints
10 MB never stalls generation. Each ending has a named outcome (`TOOL_OUTCOMES`):

- `ok`: exited 0; `output` is what it printed (stdout and stderr together);
- `tool_timeout`: still running at `timeout_s` (wall clock): killed, with everything it started;
- `tool_output_truncated`: printed more than `max_output_bytes`: killed there, `output` keeps the first bytes;
- `tool_error`: exited non-zero or died on a signal (an exception, `MemoryError` at the memory limit, a crash,
  `ENOSPC` in a full scratch folder, a refused fork); `output` ends with the error.

The boundary is the kernel's, not the interpreter's (tools/jail.py builds it; docs/extending.md says what a tool
may and may not do): mount, PID, network, IPC and UTS namespaces; a read-only root holding only the system's
programs and libraries and this Python's install prefix, a fresh /proc and a size- and inode-capped tmpfs as the
writable scratch folder; a uid of its own per call with no groups and no capabilities; `PR_SET_NO_NEW_PRIVS`; a
seccomp filter; limits on memory, CPU time, file size, open files and processes. The whole process tree dies with
the rank (parent-death signals down to the namespace's init, whose end kills the namespace), and the scratch
folder is freed by the kernel with it: nothing is deleted on the caller's loop. Where the boundary cannot be built,
`boundary_missing` names what is missing and a tool task refuses to start (`Task.check_environment`); a call
started anyway fails as `tool_error` with the failed step: never a weaker sandbox.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from pipelinerl_fsdp.tools.jail import SETUP_FAILED, UID_BASE

TOOL_OUTCOMES = ("ok", "tool_timeout", "tool_error", "tool_output_truncated")
_JAIL = str(Path(__file__).with_name("jail.py"))


def default_binds() -> tuple[str, ...]:
    """The folders a tool's interpreter needs, read-only in its root: the system's programs and libraries and
    this Python's install prefix (never the project, /root, /home, /work or /etc)."""
    system = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32") if os.path.lexists(p)]
    return (*system, os.path.realpath(sys.base_prefix))


@dataclass(frozen=True)
class ToolLimits:
    """What one call may use."""

    timeout_s: float = 5.0  # wall clock, from the start of its process
    memory_mb: int = 512  # address space of each of its processes (RLIMIT_AS)
    max_output_bytes: int = 16384  # stdout + stderr; also the largest file it may write (RLIMIT_FSIZE)
    max_processes: int = 16  # processes and threads at once, its first included (RLIMIT_NPROC of its own uid)
    max_open_files: int = 64  # per process (RLIMIT_NOFILE)
    scratch_mb: int = 16  # the scratch folder's size (tmpfs; counts against the machine's memory)
    max_files: int = 256  # files and folders in the scratch folder (tmpfs inodes)

    def settings(self, rank_pid: int, uid_base: int, binds: tuple[str, ...]) -> dict:
        """What jail.py is given: every limit, the read-only binds, the base of the call's uid."""
        cpu = int(self.timeout_s) + 2  # a CPU-time backstop behind the wall-clock deadline
        limits = {
            "RLIMIT_AS": self.memory_mb * 1024 * 1024,
            "RLIMIT_CPU": cpu,
            "RLIMIT_FSIZE": self.max_output_bytes,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_NPROC": self.max_processes,
        }
        return {
            "rank_pid": rank_pid,
            "uid_base": uid_base,
            "binds": list(binds),
            "limits": limits,
            "scratch_bytes": self.scratch_mb * 1024 * 1024,
            "scratch_files": self.max_files,
        }


@dataclass
class ToolResult:
    call_id: Hashable
    outcome: str  # one of TOOL_OUTCOMES
    output: str
    seconds: float  # from the start of its process to its end (or kill)


@dataclass
class _Running:
    call_id: Hashable
    proc: subprocess.Popen
    started: float
    out: bytearray = field(default_factory=bytearray)


def boundary_missing(binds: tuple[str, ...] | None = None, timeout_s: float = 30.0) -> list[str]:
    """What this machine lacks to build a tool's boundary (empty: nothing): a call is run through every step and
    checks from inside that each holds. A job whose task runs tools refuses to start unless this is empty."""
    check = "\n".join(
        [
            "import os, socket",
            "status = open('/proc/self/status').read()",
            "bad = []",
            f"bad += [] if os.getuid() >= {UID_BASE} else ['a uid of its own']",
            "bad += [] if 'NoNewPrivs:\\t1' in status else ['no_new_privs']",
            "bad += [] if 'Seccomp:\\t2' in status else ['seccomp filter']",
            "bad += [] if 'CapEff:\\t0000000000000000' in status else ['no capabilities']",
            "bad += [] if os.getpid() == 2 else ['a PID namespace']",
            "ifaces = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').readlines()[2:]]",
            "bad += [] if ifaces == ['lo'] else ['a network namespace']",
            "bad += [] if not os.access('/', os.W_OK) and not os.path.exists('/etc/shadow') else ['read-only root']",
            "bad += [] if os.getcwd() == '/scratch' and os.access('.', os.W_OK) else ['a writable scratch folder']",
            "print('MISSING', *bad, sep='|')",
        ]
    )
    runner = ToolRunner(ToolLimits(timeout_s=timeout_s), workers=1, binds=binds)
    runner.submit("probe", check)
    deadline = time.monotonic() + timeout_s + 5
    results: list[ToolResult] = []
    while not results and time.monotonic() < deadline:
        results = runner.poll()
        time.sleep(0.005)
    runner.close()
    if not results:
        return ["a probe call that ends (it hung)"]
    out = results[0].output
    if out.startswith(SETUP_FAILED):
        return [out[len(SETUP_FAILED) :].strip().splitlines()[0]]
    if results[0].outcome != "ok" or not out.startswith("MISSING"):
        return [f"a probe call that runs ({results[0].outcome}: {out.strip()[-300:]})"]
    return [f"the boundary's {what}" for what in out.strip().split("|")[1:]]


class ToolRunner:
    """Runs submitted Python snippets under `limits`, at most `workers` at a time, never blocking the caller.

    Calls start in `poll`; each dies when the thread that started it ends (the parent-death signal is per thread),
    so poll from the thread that runs the loop, as the inference loop does."""

    def __init__(self, limits: ToolLimits, workers: int = 2, binds: tuple[str, ...] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"ToolRunner: workers must be >= 1, got {workers}")
        self.limits, self.workers = limits, workers
        self.binds = default_binds() if binds is None else binds
        self._queue: deque[tuple[Hashable, str]] = deque()
        self._running: list[_Running] = []

    def submit(self, call_id: Hashable, code: str) -> None:
        """Queue one call; it starts at a later `poll` when a worker slot is free."""
        self._queue.append((call_id, code))

    def pending(self) -> int:
        """Calls submitted and not yet returned by `poll`."""
        return len(self._queue) + len(self._running)

    def poll(self) -> list[ToolResult]:
        """Start what fits, collect output, enforce deadlines and the output cap; the calls that ended."""
        while self._queue and len(self._running) < self.workers:
            self._start(*self._queue.popleft())
        done = []
        for run in list(self._running):
            result = self._check(run)
            if result is not None:
                self._running.remove(run)
                done.append(result)
        return done

    def close(self) -> None:
        """Kill whatever still runs; queued calls are dropped."""
        for run in self._running:
            self._kill(run)
        self._running.clear()
        self._queue.clear()

    def _start(self, call_id: Hashable, code: str) -> None:
        # the call's uid is UID_BASE + the pid of its process, which jail.py knows once it runs
        settings = self.limits.settings(os.getpid(), UID_BASE, self.binds)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _JAIL, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            close_fds=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        try:
            proc.stdin.write(code.encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading: its exit status tells why
            pass
        self._running.append(_Running(call_id, proc, time.monotonic()))

    def _check(self, run: _Running) -> ToolResult | None:
        cap = self.limits.max_output_bytes
        assert run.proc.stdout is not None
        while len(run.out) <= cap:
            try:
                chunk = run.proc.stdout.read(cap + 1 - len(run.out))
            except BlockingIOError:
                chunk = None
            if not chunk:
                break
            run.out += chunk
        seconds = time.monotonic() - run.started
        if len(run.out) > cap:
            self._kill(run)
            return self._result(run, "tool_output_truncated", seconds, bytes(run.out[:cap]))
        code = run.proc.poll()
        if code is None:
            if seconds > self.limits.timeout_s:
                self._kill(run)
                note = f"\n[tool killed after {self.limits.timeout_s:g} s]"
                return self._result(run, "tool_timeout", seconds, bytes(run.out), note)
            return None
        rest = run.proc.stdout.read() or b""  # what it printed just before exiting
        out = bytes(run.out + rest)
        if len(out) > cap:
            return self._result(run, "tool_output_truncated", seconds, out[:cap])
        if code != 0:
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            return self._result(run, "tool_error", seconds, out, f"\n[tool ended with {why}]")
        return self._result(run, "ok", seconds, out)

    @staticmethod
    def _result(run: _Running, outcome: str, seconds: float, out: bytes, note: str = "") -> ToolResult:
        return ToolResult(run.call_id, outcome, out.decode(errors="replace") + note, seconds)

    @staticmethod
    def _kill(run: _Running) -> None:
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.proc.wait()
        assert run.proc.stdout is not None
        run.proc.stdout.close()


class ToolMailbox:
    """One `ToolRunner` shared by many callers (a rank's episodes), each asking for its own call's result: a poll
    collects every call that ended, and each result waits here until its caller takes it."""

    def __init__(self, runner: ToolRunner) -> None:
        self.runner = runner
        self._done: dict[Hashable, ToolResult] = {}
        self._forgotten: set[Hashable] = set()

    def submit(self, call_id: Hashable, code: str) -> None:
        self.runner.submit(call_id, code)

    def take(self, call_id: Hashable) -> ToolResult | None:
        """The result of `call_id` once its call has ended, else None (never waits)."""
        for r in self.runner.poll():
            if r.call_id in self._forgotten:
                self._forgotten.discard(r.call_id)
            else:
                self._done[r.call_id] = r
        return self._done.pop(call_id, None)

    def forget(self, call_id: Hashable) -> None:
        """The caller no longer wants `call_id`'s result (its episode was dropped): it is discarded when it ends."""
        if self._done.pop(call_id, None) is None:
            self._forgotten.add(call_id)
