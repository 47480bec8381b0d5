"""Tool calls that cannot hurt the run: Python snippets (a calculator, a short program) run off the decode loop, each
in a fresh interpreter process with a deadline, a memory limit, a cap on output bytes, no network and no writes
outside a scratch folder of its own.

`ToolRunner.submit` queues a call and returns at once; `poll` starts queued calls while fewer than `workers` run,
reads what the running ones printed, and returns the calls that ended, without ever waiting: an inference loop
calls it between two engine steps, as it does the reward pool, so a tool that hangs, crashes, eats memory or prints
10 MB never stalls generation. Each ending has a named outcome (`TOOL_OUTCOMES`):

- `ok`: exited 0; `output` is what it printed (stdout and stderr together);
- `tool_timeout`: still running at `timeout_s` (wall clock): its process group is killed;
- `tool_output_truncated`: printed more than `max_output_bytes`: killed there, `output` keeps the first bytes;
- `tool_error`: exited non-zero or died on a signal (an exception, `MemoryError` at the memory limit, a crash, an
  attempt to reach the network or to write outside its folder); `output` ends with the error.

The limits, in the child before the snippet runs: `RLIMIT_AS` (memory), `RLIMIT_CPU` (a CPU-time backstop to the
wall-clock deadline), `RLIMIT_FSIZE` (no file larger than the output cap), a new session (the kill reaches anything
it started), a network namespace of its own where the kernel allows one (no interface but a down loopback), an
empty environment and isolated mode (`python -I -S`), the scratch folder as working directory; and a Python audit
hook (PEP 578, which the snippet cannot remove) that refuses sockets, new processes, `ctypes`, raising its own
limits (which a root process could) and any write,
removal or rename outside the scratch folder. The audit hook alone is not a security boundary against native code
written to escape it; together with the namespace and the limits it keeps a model's own mistakes (an infinite loop,
a huge list, a runaway print) and ordinary misuse (an HTTP request, writing into the repository) out of the run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

TOOL_OUTCOMES = ("ok", "tool_timeout", "tool_error", "tool_output_truncated")

# Runs in the child (python -I -S -c BOOTSTRAP MEMORY_BYTES CPU_S FILE_BYTES), single-threaded, so nothing needs
# to be done between fork and exec in a parent that has threads: the limits and the network namespace first, then
# the snippet from stdin under the audit hook.
_UNSHARE = r"""
import ctypes
def unshare_network():
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0  # NEWNET, or NEWUSER too
"""
_BOOTSTRAP = (
    _UNSHARE
    + r"""
import os, resource, sys
memory, cpu, fsize = map(int, sys.argv[1:4])
unshare_network()
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
del ctypes, unshare_network, memory, cpu, fsize
code = sys.stdin.read()
sys.stdin.close()
scratch = os.path.realpath(os.getcwd())

def inside(path):
    if isinstance(path, int):
        return True  # an already-open descriptor: its opening was checked
    real = os.path.realpath(os.fsdecode(path))
    return real == scratch or real.startswith(scratch + os.sep)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
          "pty.", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill", "sys.addaudithook",
          "resource.setrlimit", "resource.prlimit")
# events that change a path: how many of their first arguments are paths that must lie in the scratch folder
PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
               "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1, "shutil.rmtree": 1, "shutil.move": 2}

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writes and not inside(path):
            raise PermissionError(f"tool sandbox: no writes outside the scratch folder ({path!r})")
    elif event.startswith(DENIED) and event != "socket.gethostname":
        raise PermissionError(f"tool sandbox: {event} is not allowed")
    elif event in PATH_EVENTS:
        for path in args[: PATH_EVENTS[event]]:
            if path is not None and not inside(path):
                raise PermissionError(f"tool sandbox: {event} outside the scratch folder ({path!r})")

sys.addaudithook(hook)
del hook
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
)


@dataclass(frozen=True)
class ToolLimits:
    """What one call may use."""

    timeout_s: float = 5.0  # wall clock, from the start of its process
    memory_mb: int = 512  # address space (RLIMIT_AS)
    max_output_bytes: int = 16384  # stdout + stderr; also the largest file it may write


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
    scratch: str
    started: float
    out: bytearray = field(default_factory=bytearray)


def network_isolation_available() -> bool:
    """Whether a tool's process here gets a network namespace of its own (as root, or in a new user namespace
    where the kernel allows unprivileged ones); where not, only the audit hook keeps it off the network."""
    check = _UNSHARE + "\nraise SystemExit(0 if unshare_network() else 1)"
    return subprocess.run([sys.executable, "-I", "-S", "-c", check], timeout=30).returncode == 0


class ToolRunner:
    """Runs submitted Python snippets under `limits`, at most `workers` at a time, never blocking the caller."""

    def __init__(self, limits: ToolLimits, workers: int = 2, scratch_root: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"ToolRunner: workers must be >= 1, got {workers}")
        self.limits, self.workers = limits, workers
        self.scratch_root = scratch_root
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
                shutil.rmtree(run.scratch, ignore_errors=True)
                done.append(result)
        return done

    def close(self) -> None:
        """Kill whatever still runs; queued calls are dropped."""
        for run in self._running:
            self._kill(run)
            shutil.rmtree(run.scratch, ignore_errors=True)
        self._running.clear()
        self._queue.clear()

    def _start(self, call_id: Hashable, code: str) -> None:
        scratch = tempfile.mkdtemp(prefix="tool-", dir=self.scratch_root)
        lim = self.limits
        # RLIMIT_CPU: a CPU-time backstop behind the wall-clock deadline
        limits = [str(lim.memory_mb * 1024 * 1024), str(int(lim.timeout_s) + 2), str(lim.max_output_bytes)]
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, *limits],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "PYTHONHASHSEED": "0"},
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
        self._running.append(_Running(call_id, proc, scratch, time.monotonic()))

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
