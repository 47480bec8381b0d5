"""Tool calls that cannot hurt the run: each fault gives its named outcome within its deadline, while the caller's
loop (standing in for an engine's decode loop) is never blocked; and an adversarial suite, written as an attacker
would, against the operating-system boundary (tools/jail.py): every case gets its named outcome in time, nothing
reaches outside, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pipelinerl_fsdp.tasks.tool_arithmetic as tool_task
from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.preflight import check_environment
from pipelinerl_fsdp.tasks.tool_arithmetic import ToolArithmetic, ToolArithmeticConfig
from pipelinerl_fsdp.tools.jail import UID_BASE, seccomp_program
from pipelinerl_fsdp.tools.sandbox import (
    TOOL_OUTCOMES,
    ToolLimits,
    ToolResult,
    ToolRunner,
    boundary_missing,
    default_binds,
)

LIMITS = ToolLimits(timeout_s=2.0, memory_mb=256, max_output_bytes=4096)
# how long after its deadline a call may end: the poll that sees the deadline pass comes late while fork and CPU
# bombs hold both cores of a 2-core machine
LATE_S = 2.5
ROOT = Path(__file__).resolve().parents[3]  # the project's files: never visible to a tool


def run_all(runner: ToolRunner, calls: dict[str, str], budget_s: float = 60.0) -> tuple[dict[str, ToolResult], float]:
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


def sandboxed_pids() -> set[int]:
    """Processes on this machine running as a tool call's uid."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            if uid >= UID_BASE:
                pids.add(int(entry))
    return pids


def wait_gone(before: set[int], within_s: float = 3.0) -> set[int]:
    """The tool processes not in `before` still alive after `within_s` (the kernel tears a namespace down
    asynchronously, so this polls)."""
    deadline = time.monotonic() + within_s
    while (left := sandboxed_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


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
    for k in ("hang", "sleep"):  # killed at the deadline, not long after: lateness measured from the deadline
        assert 0 <= res[k].seconds - LIMITS.timeout_s < LATE_S, (k, res[k].seconds)
    # never waits on a tool: the longest poll is far below any deadline (measured: a few ms)
    assert longest < 0.5, longest
    assert wall < 3 * (LIMITS.timeout_s + 1.0)  # 7 calls, 3 at a time, two of them hanging to their deadline


def test_a_file_larger_than_the_cap_cannot_be_written_nor_more_than_the_scratch_folder_holds():
    runner = ToolRunner(LIMITS)
    res, _ = run_all(runner, {"big": "open('big.bin', 'wb').write(b'x' * 100_000)"})
    assert res["big"].outcome == "tool_error"  # SIGXFSZ or the OSError it raises
    # files of 100 kB each (under their cap) until the 1 MB tmpfs is full: the size, not the file count, stops it
    roomy = ToolLimits(timeout_s=2.0, max_output_bytes=200_000, scratch_mb=1, max_files=10_000)
    fill = "i = 0\ntry:\n    while True:\n        open(f'f{i}', 'wb').write(b'z' * 100_000)\n        i += 1\n"
    fill += "except OSError as e:\n    print(i, e.strerror)"
    res, _ = run_all(ToolRunner(roomy), {"fill": fill})
    assert res["fill"].outcome == "ok" and res["fill"].output == "10 No space left on device\n", res["fill"].output


def test_close_kills_what_runs_and_the_worker_count_is_checked():
    runner = ToolRunner(LIMITS)
    before = sandboxed_pids()
    runner.submit("sleep", "import time\ntime.sleep(60)")
    runner.poll()
    pid = runner._running[0].proc.pid
    runner.close()
    assert runner.pending() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not wait_gone(before)
    with pytest.raises(ValueError, match="workers"):
        ToolRunner(LIMITS, workers=0)


def _refused(targets: list[str], attempt: str) -> str:
    """A snippet that tries `attempt` (an expression of `t`) on every target and prints how each was refused:
    'refused ENOENT,EROFS,...'; anything that got through is printed as 'ESCAPED t'."""
    return textwrap.dedent(
        f"""
        import errno, os, shutil, sqlite3, mmap, tempfile
        codes = []
        for t in {targets!r}:
            try:
                {attempt}
            except Exception as e:
                codes.append(errno.errorcode.get(getattr(e, 'errno', None) or 0, type(e).__name__))
            else:
                print('ESCAPED', t)
        print('refused', ','.join(codes))
        """
    )


# name: (snippet, the outcome it must get, a check of its output); {out} is a host path no tool may reach
def adversarial_cases(out: Path, tcp_port: int, unix_path: str, abstract: bytes) -> dict[str, tuple[str, str, str]]:
    rank = os.getpid()
    files = [str(out / "w.txt"), str(ROOT / "escaped.txt"), "/usr/escaped.txt", "/escaped.txt", "/proc/escaped"]
    cases = {
        # the old sandbox's escapes: rebinding the audit hook's globals, then writing and connecting
        "hook_rebinding": (
            "import __main__\n__main__.inside = lambda p: True\n__main__.DENIED = ()\n"
            f"open({str(out / 'hooked.txt')!r}, 'w').write('x')",
            "tool_error",
            "FileNotFoundError",
        ),
        # reading outside
        "read_project_files": (f"print(open({str(ROOT / 'README.md')!r}).read()[:50])", "tool_error", "Errno 2"),
        "read_etc_shadow": ("print(open('/etc/shadow').read())", "tool_error", "Errno 2"),
        "read_rank_environ": (f"print(open('/proc/{rank}/environ').read())", "tool_error", "Errno 2"),
        "list_root": ("import os\nprint(sorted(os.listdir('/')))", "ok", "['bin', 'dev', 'lib'"),
        # writing through every API
        "write_open": (_refused(files, "open(t, 'w').write('x')"), "ok", "refused ENOENT,ENOENT,EROFS,EROFS,ENOENT"),
        "write_os": (_refused(files, "os.close(os.open(t, os.O_CREAT | os.O_WRONLY))"), "ok", "refused ENOENT"),
        "write_shutil": (_refused(files, "shutil.copy('/usr/bin/true', t)"), "ok", "refused ENOENT"),
        "write_sqlite3": (_refused(files, "sqlite3.connect(t).execute('create table x (y)')"), "ok", "refused"),
        "write_mmap": (
            _refused(["/usr/bin/true"], "mmap.mmap(os.open(t, os.O_RDONLY), 0, prot=mmap.PROT_WRITE)"),
            "ok",
            "refused EACCES",
        ),
        "write_tempfile": (_refused(files[:4], "tempfile.mkstemp(dir=os.path.dirname(t))"), "ok", "refused ENOENT"),
        "write_rename_chmod": (
            _refused(["/usr/bin/true", "/proc/1"], "os.rename(t, t + '.x') if t[1] == 'u' else os.chmod(t, 0)"),
            "ok",
            "refused EROFS,EPERM",
        ),
        "scratch_is_writable": (
            "import tempfile\nf = tempfile.NamedTemporaryFile(dir=None)\nf.write(b'x')\nf.flush()\n"
            "print(open('notes.txt', 'w').write('kept'), open('notes.txt').read(), f.name.startswith('/scratch/'))",
            "ok",
            "4 kept True",
        ),
        "setuid_root": ("import os\nos.setuid(0)", "tool_error", "PermissionError"),
        "raise_limits": (
            "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
            "tool_error",
            "ValueError: not allowed to raise maximum limit",
        ),
        # processes every way: they run, inside the same boundary
        "os_system": (f"import os\nos.system('id -u; touch {out}/sys.txt || echo refused')", "ok", "refused"),
        "subprocess": (
            "import subprocess\nprint(subprocess.run(['sh', '-c', 'cat /etc/shadow || echo refused'], "
            "capture_output=True, text=True).stdout)",
            "ok",
            "refused",
        ),
        "fork_exec": (
            "import _posixsubprocess, os\nr, w = os.pipe()\n"
            f"pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'touch {out}/fe.txt || echo refused'], "
            "[b'/bin/sh'], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, "
            "None, -1, None, False)\nos.waitpid(pid, 0)",
            "ok",
            "refused",
        ),
        "multiprocessing": (
            "import multiprocessing as mp, os\n"
            "def f():\n    print('child uid', os.getuid() >= 10**9, flush=True)\n"
            "p = mp.get_context('fork').Process(target=f)\np.start()\np.join()\nprint('exit', p.exitcode)",
            "ok",
            "child uid True",
        ),
        "os_fork": (
            "import os\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\n"
            "print('detached child left behind')",
            "ok",
            "detached",
        ),
        "fork_bomb": (  # every process forks until the kernel refuses; the first says so and fails
            "import os\ntry:\n    while True:\n        os.fork()\nexcept BlockingIOError as e:\n"
            "    if os.getpid() != 2:\n        os._exit(1)\n    print('fork refused:', e.strerror)\n    raise",
            "tool_error",
            "fork refused: Resource temporarily unavailable",
        ),
        "patient_fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "tool_timeout",
            "",
        ),
        # sockets of every family, listeners of the rank's included
        "tcp_to_rank": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {tcp_port}), timeout=1)",
            "tool_error",
            "Network is unreachable",
        ),
        "tcp6": (  # no loopback in the tool's network namespace
            "import socket\nsocket.create_connection(('::1', 80), timeout=1)",
            "tool_error",
            "Cannot assign requested address",
        ),
        "dns_and_internet": (
            "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
            "tool_error",
            "Network is unreachable",
        ),
        "unix_path_listener": (
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix_path!r})",
            "tool_error",
            "FileNotFoundError",
        ),
        "unix_abstract_listener": (
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({abstract!r})",
            "tool_error",
            "ConnectionRefusedError",
        ),
        "other_families": (
            _refused(
                [17, 16, 40, 31, 38, 30, 44, 3],  # packet, netlink, vsock, bluetooth, alg, tipc, xdp, ax25
                "__import__('socket').socket(t, 2 if t in (16, 17) else 1)",
            ),
            "ok",
            "refused " + ",".join(["EAFNOSUPPORT"] * 8),
        ),
        # signals and kernel interfaces
        "kill_rank": (f"import os, signal\nos.kill({rank}, signal.SIGKILL)", "tool_error", "ProcessLookupError"),
        "kill_init": ("import os, signal\nos.kill(1, signal.SIGKILL)", "tool_error", "PermissionError"),
        "kill_everything": (
            "import os, signal, time\nif os.fork() == 0:\n    time.sleep(60)\nos.kill(-1, signal.SIGKILL)\n"
            "print('alive', os.wait()[1])",
            "ok",
            "alive 9",
        ),
        "native_syscalls": (
            textwrap.dedent(
                """
                import ctypes, os
                libc = ctypes.CDLL(None, use_errno=True)
                for name, call in [('unshare', lambda: libc.unshare(0x10000000)),
                                   ('mount', lambda: libc.mount(b'none', b'/scratch', b'tmpfs', 0, None)),
                                   ('ptrace', lambda: libc.ptrace(16, 1, 0, 0)),
                                   ('bpf', lambda: libc.syscall(321, 0, 0, 0)),
                                   ('io_uring', lambda: libc.syscall(425, 1, 0)),
                                   ('keyctl', lambda: libc.syscall(250, 0, 0)),
                                   ('clone_newuser', lambda: libc.syscall(56, 0x10000011, 0, 0, 0, 0))]:
                    print(name, call(), os.strerror(ctypes.get_errno()))
                """
            ),
            "ok",
            "unshare -1 Operation not permitted\nmount -1 Operation not permitted\nptrace -1 Operation not permitted",
        ),
        # bombs (one process's memory bomb: the fault test's "memory")
        "memory_bomb_in_children": (
            "import os\nfor _ in range(8):\n    if os.fork() == 0:\n        try:\n"
            "            x = bytearray(1024**3)\n        except MemoryError:\n            print('M', flush=True)\n"
            "        os._exit(0)\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n"
            "        break",
            "ok",
            "M\nM\nM\nM\nM\nM\nM\nM",
        ),
        "cpu_bomb": ("import os\nfor _ in range(3):\n    os.fork()\nwhile True:\n    pass", "tool_timeout", ""),
        "output_bomb": ("import os\nos.write(1, b'y' * 10_000_000)", "tool_output_truncated", "yyyy"),
        "file_count_bomb": (
            "i = 0\nwhile True:\n    open(f'f{i}', 'w').close()\n    i += 1",
            "tool_error",
            "No space left on device",
        ),
        "open_files_bomb": ("fs = [open('/dev/null') for _ in range(10_000)]", "tool_error", "Too many open files"),
    }
    return cases


def test_adversarial_suite_every_case_gets_its_outcome_and_nothing_escapes_or_stays(tmp_path: Path):
    out = tmp_path / "outside"
    out.mkdir()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    unix_path = str(tmp_path / "listener.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(1)
    abstract = b"\0pipelinerl-tool-test-%d" % os.getpid()
    abst = socket.socket(socket.AF_UNIX)
    abst.bind(abstract)
    abst.listen(1)
    listeners = (tcp, unix, abst)
    for s in listeners:
        s.setblocking(False)
    cases = adversarial_cases(out, tcp.getsockname()[1], unix_path, abstract)
    before, mounts = sandboxed_pids(), Path("/proc/self/mountinfo").read_text()
    limits = ToolLimits(timeout_s=2.0, memory_mb=256, max_output_bytes=4096, scratch_mb=1, max_files=64)
    runner = ToolRunner(limits, workers=4)
    t0 = time.monotonic()
    try:
        res, longest = run_all(runner, {k: code for k, (code, _, _) in cases.items()})
    finally:
        runner.close()
    wall = time.monotonic() - t0
    rows = [f"{'case':26} {'outcome':22} {'s':>5}  output (last line)"]
    for k in cases:
        lines = [line for line in res[k].output.splitlines() if line.strip() and not line.startswith("[tool ")]
        last = (lines or [""])[-1][:70]
        rows.append(f"{k:26} {res[k].outcome:22} {res[k].seconds:5.2f}  {last}")
    rows.append(f"{len(cases)} cases, 4 at a time: {wall:.1f} s, longest poll {longest * 1e3:.1f} ms")
    print("\n" + "\n".join(rows))
    for s in listeners:  # no tool reached a listener of the rank
        with pytest.raises(BlockingIOError):
            s.accept()
        s.close()
    bad = {
        k: (res[k].outcome, res[k].output[-300:])
        for k, (_, want, expect) in cases.items()
        if res[k].outcome != want or expect not in res[k].output or "ESCAPED" in res[k].output
    }
    assert not bad, bad
    # each ended by its deadline, or was killed soon after it: lateness measured from the deadline (a call that
    # ended before it is not late)
    late = {k: round(r.seconds - limits.timeout_s, 2) for k, r in res.items() if r.seconds > limits.timeout_s}
    assert all(s < LATE_S for s in late.values()), late
    assert all(k in late for k, r in res.items() if r.outcome == "tool_timeout"), late  # never killed early
    assert longest < 0.5, longest  # the loop was never blocked
    assert list(out.iterdir()) == [] and not (ROOT / "escaped.txt").exists() and not Path("/usr/escaped.txt").exists()
    assert not wait_gone(before), "tool processes left behind"
    assert Path("/proc/self/mountinfo").read_text() == mounts  # no mount leaked into the rank's namespace


def test_no_tool_process_outlives_a_sigkilled_rank(tmp_path: Path):
    rank = textwrap.dedent(
        """
        import sys, time
        from pipelinerl_fsdp.tools.sandbox import ToolLimits, ToolRunner
        runner = ToolRunner(ToolLimits(timeout_s=60))
        code = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\nprint('up', flush=True)\\ntime.sleep(60)"
        runner.submit(1, code)
        runner.poll()
        while b'up' not in runner._running[0].out:
            runner.poll()
            time.sleep(0.01)
        print(runner._running[0].proc.pid, flush=True)
        time.sleep(60)
        """
    )
    before = sandboxed_pids()
    proc = subprocess.Popen(
        [sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.stdout is not None
    keeper = int(proc.stdout.readline())
    assert len(sandboxed_pids() - before) >= 2  # the snippet and its detached child
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not wait_gone(before), "tool processes outlived the rank"
    status = Path(f"/proc/{keeper}/status")  # gone, or a zombie this machine's init has not reaped yet
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_the_boundary_is_complete_here_and_a_failed_step_is_named():
    assert boundary_missing() == []
    missing = boundary_missing(binds=(*default_binds(), "/no/such/folder"))
    assert missing == ["read-only view: /no/such/folder does not exist"], missing
    assert len(seccomp_program()) % 8 == 0


def test_a_tool_task_refuses_to_start_where_the_boundary_cannot_be_built(monkeypatch: pytest.MonkeyPatch):
    cfg = ToolArithmeticConfig(name="tool_arithmetic")
    task = ToolArithmetic(cfg)
    check_environment(cfg, task)  # the boundary holds here: no error
    failed = ["unshare mount/PID/network/IPC/UTS namespaces: Operation not permitted (errno 1)"]
    monkeypatch.setattr(tool_task, "boundary_missing", lambda: failed)
    with pytest.raises(ConfigError, match=r"task.name = tool_arithmetic: .*unshare mount/PID/network/IPC/UTS"):
        check_environment(cfg, task)
