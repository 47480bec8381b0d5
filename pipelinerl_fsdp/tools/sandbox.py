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

Each `tool_error` says how the call ended: an exit status, a signal by name (real-time ones included, with why for
SIGKILL, SIGSYS, SIGXCPU, ...), the sandbox's init dying first, or a setup step that failed. Nothing a call does
raises in `poll`: a fault in the runner's own result path ends that call as `tool_error` and keeps the others.

The boundary is the kernel's, not the interpreter's (tools/jail.py builds it; docs/extending.md says what a tool
may and may not do, docs/sandbox.md what it promises): mount, PID, network, IPC (with its own SysV limits) and UTS
namespaces; a read-only root holding only the system's programs and libraries and this Python's standard library,
a /proc of the call's own processes and a size- and inode-capped tmpfs as the writable scratch folder; a random
uid per call with no groups and no capabilities; `PR_SET_NO_NEW_PRIVS`; a seccomp allowlist
(tools/seccomp_policy.py); every resource limit. The deadline is kept by the call's keeper (its own timer, even if
nobody polls), which kills and reaps the namespace's init, so nothing of a call outlives it, not even a zombie;
the whole tree also dies with the rank (parent-death signals), and the scratch folder is freed by the kernel with
it: nothing is deleted on the caller's loop. Where the boundary cannot be built,
`boundary_missing` names what is missing and a tool task refuses to start (`Task.check_environment`); a call
started anyway fails as `tool_error` with the failed step: never a weaker sandbox.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from pipelinerl_fsdp.tools import jail
from pipelinerl_fsdp.tools.jail import SETUP_FAILED, UID_BASE, UID_SPAN
from pipelinerl_fsdp.tools.seccomp_policy import SeccompUnavailable

TOOL_OUTCOMES = ("ok", "tool_timeout", "tool_error", "tool_output_truncated")
_JAIL_SOURCE = Path(jail.__file__).read_bytes()
_END_GRACE_S = 2.0  # a keeper asked to end that still runs after this is killed with its process group


def default_binds() -> tuple[str, ...]:
    """The folders a tool's interpreter needs, read-only in its root: the system's programs and libraries and
    this Python's standard library (never the project, site-packages, /root, /home, /work or /etc; with conda,
    never the other environments nor the package cache)."""
    system = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32") if os.path.lexists(p)]
    return (*system, os.path.realpath(os.path.dirname(os.__file__)))


def signal_name(number: int) -> str:
    """A signal's name for any number the kernel can deliver: SIGSEGV, SIGRTMIN+3 (real-time signals have none in
    Python's enum), or 'signal 99'."""
    try:
        return signal.Signals(number).name
    except ValueError:
        pass
    if signal.SIGRTMIN < number <= signal.SIGRTMAX:
        return f"SIGRTMIN+{number - signal.SIGRTMIN}"
    return f"signal {number}"


_WHY = {
    signal.SIGKILL: "killed: by the kernel's OOM killer or from outside",
    signal.SIGSYS: "a system call the sandbox does not allow",
    signal.SIGXCPU: "its CPU-time limit",
    signal.SIGXFSZ: "its file-size limit",
    signal.SIGSEGV: "a crash",
}


def describe_end(end: dict) -> str:
    """How a process ended, from the keeper's report ({'signal': n} or {'code': n}), in words."""
    if "signal" in end:
        sig = int(end["signal"])
        why = _WHY.get(sig)
        return f"signal {signal_name(sig)}" + (f" ({why})" if why else "")
    return f"exit status {end.get('code')}"


@functools.cache
def _seccomp_hex() -> str:
    return jail.seccomp_program().hex()


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
    ipc_kb: int = 1024  # each of: SysV shared memory, SysV message queues, POSIX message queues, /dev/shm

    def rlimits(self) -> dict[str, int]:
        """Every resource limit of a snippet's process, each set explicitly (none inherited from the rank)."""
        memory = self.memory_mb * 1024 * 1024
        cpu = int(self.timeout_s) + 2  # a CPU-time backstop behind the wall-clock deadline
        return {
            "RLIMIT_AS": memory,
            "RLIMIT_DATA": memory,
            "RLIMIT_STACK": min(8 * 1024 * 1024, memory),
            "RLIMIT_RSS": memory,  # not enforced by Linux; set so that nothing is inherited
            "RLIMIT_CPU": cpu,
            "RLIMIT_RTTIME": 0,  # no real-time scheduling (RTPRIO 0 too): nothing can starve the host
            "RLIMIT_RTPRIO": 0,
            "RLIMIT_NICE": 0,  # may lower its priority, never raise it
            "RLIMIT_FSIZE": self.max_output_bytes,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_LOCKS": self.max_open_files,  # not enforced since Linux 2.4.25; set so that nothing is inherited
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_MEMLOCK": 0,  # no pinned pages
            "RLIMIT_SIGPENDING": 64,  # queued signals of its uid
            "RLIMIT_MSGQUEUE": self.ipc_kb * 1024,
        }

    def memory_bound_bytes(self) -> int:
        """The most memory one call can hold, all kinds counted: every process at its address-space limit, the
        scratch folder, and the IPC budget four times (SysV shared memory, SysV message queues, POSIX message
        queues, /dev/shm); kernel objects beyond these, such as pipe buffers, are bounded by open files x processes
        and the kernel's per-user pipe limit."""
        per_process = self.memory_mb * 1024 * 1024
        return self.max_processes * per_process + self.scratch_mb * 1024 * 1024 + 4 * self.ipc_kb * 1024

    def settings(self, rank_pid: int, uid: int, binds: tuple[str, ...], deadline: float, status_fd: int) -> dict:
        """What jail.py is given on its stdin: every limit, the read-only binds, the call's uid, its deadline."""
        return {
            "rank_pid": rank_pid,
            "uid": uid,
            "binds": list(binds),
            "limits": self.rlimits(),
            "scratch_bytes": self.scratch_mb * 1024 * 1024,
            "scratch_files": self.max_files,
            "ipc_bytes": self.ipc_kb * 1024,
            "deadline": deadline,  # time.monotonic() (CLOCK_MONOTONIC: the same clock in every process)
            "status_fd": status_fd,
            "seccomp": _seccomp_hex(),
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
    status: int  # the read end of the keeper's status pipe
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
            "bad += [] if os.listdir('/proc') and not os.path.exists('/proc/1') else ['a /proc of its own processes']",
            "ifaces = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').readlines()[2:]]",
            "bad += [] if ifaces == ['lo'] else ['a network namespace']",
            "bad += [] if not os.access('/', os.W_OK) and not os.path.exists('/etc/shadow') else ['read-only root']",
            "bad += [] if os.getcwd() == '/scratch' and os.access('.', os.W_OK) else ['a writable scratch folder']",
            "print('MISSING', *bad, sep='|')",
        ]
    )
    try:
        jail.seccomp_program()
    except SeccompUnavailable as e:
        return [str(e)]
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
    so poll from the thread that runs the loop, as the inference loop does. Nothing a snippet does raises here:
    every way a call can end is a `ToolResult` with a named outcome."""

    def __init__(self, limits: ToolLimits, workers: int = 2, binds: tuple[str, ...] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"ToolRunner: workers must be >= 1, got {workers}")
        self.limits, self.workers = limits, workers
        self.binds = default_binds() if binds is None else binds
        self._queue: deque[tuple[Hashable, str]] = deque()
        self._running: list[_Running] = []
        self._ending: list[tuple[subprocess.Popen, float]] = []  # keepers asked to end, not yet reaped
        self._failed: list[ToolResult] = []  # calls that could not start

    def submit(self, call_id: Hashable, code: str) -> None:
        """Queue one call; it starts at a later `poll` when a worker slot is free."""
        self._queue.append((call_id, code))

    def pending(self) -> int:
        """Calls submitted and not yet returned by `poll`."""
        return len(self._queue) + len(self._running) + len(self._failed)

    def poll(self) -> list[ToolResult]:
        """Start what fits, collect output, enforce deadlines and the output cap; the calls that ended."""
        self._reap()
        while self._queue and len(self._running) < self.workers:
            self._start(*self._queue.popleft())
        done, self._failed = self._failed, []
        for run in list(self._running):
            try:
                result = self._check(run)
            except Exception as e:  # never raise into the caller's loop: the call ends, named
                self._end(run)
                result = self._result(run, "tool_error", time.monotonic() - run.started, bytes(run.out))
                result.output += f"\n[tool sandbox error: {type(e).__name__}: {e}]"
            if result is not None:
                self._running.remove(run)
                done.append(result)
        return done

    def close(self) -> None:
        """Kill whatever still runs and reap it (waits up to a few seconds); queued calls are dropped."""
        for run in self._running:
            self._end(run)
        self._running.clear()
        self._queue.clear()
        self._failed.clear()
        deadline = time.monotonic() + _END_GRACE_S
        for proc, _ in self._ending:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(proc)
                proc.wait()
        self._ending.clear()

    def _start(self, call_id: Hashable, code: str) -> None:
        status_r, status_w = os.pipe()
        started = time.monotonic()
        uid = UID_BASE + secrets.randbelow(UID_SPAN)  # drawn: see docs/sandbox.md, why not a pid
        try:
            settings = self.limits.settings(os.getpid(), uid, self.binds, started + self.limits.timeout_s, status_w)
            proc = subprocess.Popen(
                [os.path.realpath(sys.executable), "-I", "-S", "-c", jail.LOADER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_w,),
            )
        except Exception as e:  # no process (EAGAIN, EMFILE) or no seccomp filter: the call fails, the loop goes on
            os.close(status_r)
            os.close(status_w)
            self._failed.append(ToolResult(call_id, "tool_error", f"[tool could not start: {e}]", 0.0))
            return
        os.close(status_w)
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        os.set_blocking(status_r, False)
        try:
            proc.stdin.write(b"%d\n" % len(_JAIL_SOURCE) + _JAIL_SOURCE)
            proc.stdin.write(json.dumps(settings).encode() + b"\n" + code.encode(errors="replace"))
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading: its status tells why
            pass
        self._running.append(_Running(call_id, proc, started, status_r))

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
            self._end(run)
            return self._result(run, "tool_output_truncated", seconds, bytes(run.out[:cap]))
        code = run.proc.poll()
        if code is None:
            if seconds > self.limits.timeout_s:
                self._end(run)
                return self._result(run, "tool_timeout", seconds, bytes(run.out), self._timeout_note())
            return None
        rest = run.proc.stdout.read() or b""  # what it printed just before exiting
        end = self._status(run)
        out = bytes(run.out + rest)
        self._close(run)
        if len(out) > cap:
            return self._result(run, "tool_output_truncated", seconds, out[:cap])
        kind = end.get("end")
        if kind == "timeout":  # the keeper's own timer (the caller did not poll in time)
            return self._result(run, "tool_timeout", seconds, out, self._timeout_note())
        if kind == "snippet":
            how = str(end.get("how", ""))
            if how == "E0":
                return self._result(run, "ok", seconds, out)
            why = describe_end({"signal": how[1:]} if how[:1] == "S" else {"code": how[1:]})
            return self._result(run, "tool_error", seconds, out, f"\n[tool ended with {why}]")
        if kind == "init":
            why = f"the sandbox's init died first ({describe_end(end)})"
        elif kind == "setup":
            why = "its sandbox could not be built"
        else:
            why = f"its sandbox's keeper ended with {describe_end({'signal': -code} if code < 0 else {'code': code})}"
        return self._result(run, "tool_error", seconds, out, f"\n[tool ended: {why}]")

    def _timeout_note(self) -> str:
        return f"\n[tool killed after {self.limits.timeout_s:g} s]"

    @staticmethod
    def _status(run: _Running) -> dict:
        """The keeper's last word (one JSON line), or {} where it wrote none (it was killed)."""
        try:
            data = os.read(run.status, 4096)
        except OSError:
            return {}
        try:
            end = json.loads(data.decode().splitlines()[0]) if data.strip() else {}
        except (ValueError, IndexError):
            return {}
        return end if isinstance(end, dict) else {}

    @staticmethod
    def _result(run: _Running, outcome: str, seconds: float, out: bytes, note: str = "") -> ToolResult:
        return ToolResult(run.call_id, outcome, out.decode(errors="replace") + note, seconds)

    @staticmethod
    def _close(run: _Running) -> None:
        assert run.proc.stdout is not None
        run.proc.stdout.close()
        if run.status >= 0:
            os.close(run.status)
            run.status = -1

    def _end(self, run: _Running) -> None:
        """Ask the keeper to end the call (it kills and reaps the namespace's init, so nothing is left, not even a
        zombie); it is reaped by a later poll, without waiting here."""
        try:
            run.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        self._close(run)
        self._ending.append((run.proc, time.monotonic()))

    def _reap(self) -> None:
        now, still = time.monotonic(), []
        for proc, asked in self._ending:
            if proc.poll() is not None:
                continue
            if now - asked > _END_GRACE_S:  # a keeper that does not end (it should never happen): force it
                _killpg(proc)
            still.append((proc, asked))
        self._ending = still


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
