"""The sandbox's second adversarial round (tools/jail.py, tools/sandbox.py), written as an attacker would, with every
snippet sent through `ToolMailbox(ToolRunner(...))` as the engine sends it. One test per class of attack, each with
two or more cases of its own and a printed table of outcomes:

- endings: every way a child can end (any signal, real-time ones included; any exit code; a core-dumping signal; a
  SIGKILL as the OOM killer sends it; an init that dies first) is a named tool outcome and nothing raises in the
  caller's loop;
- leftovers: calls killed at their deadline, at the output cap and by `close` leave no process (zombies included),
  no IPC object and no mount;
- deadline: a call's deadline holds while the caller does not poll;
- ipc: SysV shared memory and message queues are bounded by the call's IPC budget;
- rlimits: every resource limit is set explicitly (real-time priority, locked memory, niceness, ...);
- visibility: read-only devices, no settings in the command line, a /proc of the call's own processes, only the
  standard library of the interpreter bound;
- uid: each call draws a uid of its own, not derived from a pid.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

from pipelinerl_fsdp.tools.jail import RLIMIT_NUMBERS, UID_BASE, UID_SPAN
from pipelinerl_fsdp.tools.leftovers import my_children, tool_pids
from pipelinerl_fsdp.tools.sandbox import TOOL_OUTCOMES, ToolLimits, ToolMailbox, ToolResult, ToolRunner

LIMITS = ToolLimits(timeout_s=2.0, memory_mb=256, max_output_bytes=4096, ipc_kb=256)
ROOT = Path(__file__).resolve().parents[3]
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def through_mailbox(
    runner: ToolRunner, calls: dict[str, str], budget_s: float = 30.0, during=None
) -> tuple[dict[str, ToolResult], float]:
    """Submit `calls` through a ToolMailbox and take each result as an episode would; `during(runner)` runs at
    every iteration (to act on the calls from outside). Returns the results and the longest `take`."""
    box = ToolMailbox(runner)
    for call_id, code in calls.items():
        box.submit(call_id, code)
    results: dict[str, ToolResult] = {}
    longest, deadline = 0.0, time.monotonic() + budget_s
    while len(results) < len(calls):
        assert time.monotonic() < deadline, f"calls still pending: {sorted(set(calls) - set(results))}"
        for call_id in calls:
            if call_id not in results:
                t0 = time.perf_counter()
                got = box.take(call_id)  # raises if the runner raises: the test fails
                longest = max(longest, time.perf_counter() - t0)
                if got is not None:
                    results[call_id] = got
        if during is not None:
            during(runner)
        time.sleep(0.005)
    return results, longest


def table(title: str, results: dict[str, ToolResult]) -> None:
    """The class's outcomes, printed (pytest -s shows them; CI keeps them in the log)."""
    rows = [f"[{title}]", f"{'case':28} {'outcome':22} {'s':>5}  end"]
    for k, r in results.items():
        lines = [line for line in r.output.splitlines() if line.strip()]
        rows.append(f"{k:28} {r.outcome:22} {r.seconds:5.2f}  {(lines or [''])[-1][:80]}")
    print("\n" + "\n".join(rows))


def check(results: dict[str, ToolResult], want: dict[str, tuple[str, str]]) -> None:
    """Each case's outcome and a part of its output (the named end)."""
    assert {r.outcome for r in results.values()} <= set(TOOL_OUTCOMES)
    bad = {
        k: (results[k].outcome, results[k].output[-300:])
        for k, (outcome, text) in want.items()
        if results[k].outcome != outcome or text not in results[k].output
    }
    assert not bad, bad


def host_ipc() -> tuple[str, str, str]:
    return tuple(Path(f"/proc/sysvipc/{k}").read_text() for k in ("shm", "msg", "sem"))  # type: ignore[return-value]


def test_endings_every_way_a_child_ends_is_a_named_outcome_and_nothing_raises():
    kill_from_outside: dict[str, int] = {}

    def outside(runner: ToolRunner) -> None:
        """Kill, as the OOM killer would, the snippet of 'oom_killed' and the init of 'init_dies_first' once each
        has printed 'up' (found from the host: the keeper's child is the init, the init's child the snippet)."""
        for run in runner._running:
            if run.call_id in ("oom_killed", "init_dies_first") and b"up" in run.out:
                if run.call_id in kill_from_outside:
                    continue
                init = int(Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children").read_text().split()[0])
                target = init
                if run.call_id == "oom_killed":
                    target = int(Path(f"/proc/{init}/task/{init}/children").read_text().split()[0])
                kill_from_outside[run.call_id] = target
                os.kill(target, 9)

    wait = "print('up', flush=True)\nimport time\ntime.sleep(30)"
    calls = {
        "realtime_34": "import os\nos.kill(os.getpid(), 34)",
        "realtime_40": "import os\nos.kill(os.getpid(), 40)",
        "realtime_64": "import os\nos.kill(os.getpid(), 64)",
        "sigkill_self": "import os\nos.kill(os.getpid(), 9)",
        "segfault": "import ctypes\nctypes.string_at(0)",
        "abort_core": "import os\nos.abort()",
        "sigbus": "import os\nos.kill(os.getpid(), 7)",
        "exit_255": "import os\nos._exit(255)",
        "exit_125": "import os\nos._exit(125)",  # the sandbox's own setup code: still the snippet's end
        "exit_message": "raise SystemExit('bye')",
        "exit_negative": "import sys\nsys.exit(-1)",
        "oom_killed": wait,
        "init_dies_first": wait,
        "ok": "print(6 * 7)",
    }
    runner = ToolRunner(LIMITS, workers=len(calls))
    before = tool_pids()
    try:
        res, longest = through_mailbox(runner, calls, during=outside)
    finally:
        runner.close()
    table("endings", res)
    check(
        res,
        {
            "realtime_34": ("tool_error", "signal SIGRTMIN]"),
            "realtime_40": ("tool_error", "signal SIGRTMIN+6]"),
            "realtime_64": ("tool_error", "signal SIGRTMAX]"),
            "sigkill_self": ("tool_error", "signal SIGKILL"),
            "segfault": ("tool_error", "signal SIGSEGV"),
            "abort_core": ("tool_error", "signal SIGABRT"),
            "sigbus": ("tool_error", "signal SIGBUS"),
            "exit_255": ("tool_error", "exit status 255"),
            "exit_125": ("tool_error", "exit status 125"),
            "exit_message": ("tool_error", "bye\n\n[tool ended with exit status 1]"),
            "exit_negative": ("tool_error", "exit status 255"),
            "oom_killed": ("tool_error", "signal SIGKILL (killed"),
            "init_dies_first": ("tool_error", "the sandbox's init died first (signal SIGKILL"),
            "ok": ("ok", "42"),
        },
    )
    assert set(kill_from_outside) == {"oom_killed", "init_dies_first"}
    for k in ("oom_killed", "init_dies_first"):  # ended at the kill, not at the deadline
        assert res[k].seconds < LIMITS.timeout_s, (k, res[k].seconds)
    assert longest < 0.5, longest
    assert not any("Traceback" in r.output and "jail" in r.output for r in res.values())  # nothing of the host
    deadline = time.monotonic() + 3
    while tool_pids() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not tool_pids() - before


def test_endings_a_broken_call_never_raises_in_poll_and_other_results_are_kept(monkeypatch: pytest.MonkeyPatch):
    """A fault inside the runner's own result path (here: the status pipe unreadable) ends that call as
    tool_error; the calls collected in the same poll are returned, and later polls go on."""
    runner = ToolRunner(LIMITS, workers=3)
    real = ToolRunner._status

    def broken(run):
        if run.call_id == "broken":
            raise RuntimeError("status unreadable")
        return real(run)

    monkeypatch.setattr(ToolRunner, "_status", staticmethod(broken))
    try:
        res, _ = through_mailbox(runner, {"a": "print(1)", "broken": "print(2)", "b": "print(3)"})
    finally:
        runner.close()
    table("endings: a fault in the runner", res)
    check(
        res,
        {
            "a": ("ok", "1"),
            "broken": ("tool_error", "[tool sandbox error: RuntimeError: status unreadable]"),
            "b": ("ok", "3"),
        },
    )


@pytest.fixture
def subreaper():
    """This process as the child subreaper for the test: every process of a call orphaned by its keeper comes
    here, where it is seen (a zombie included); reaped afterwards."""
    assert _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in my_children():
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass


def test_leftovers_killed_calls_leave_no_process_zombie_ipc_object_or_mount(subreaper):
    n = 1000  # ~5 s here (2 cores); benchmarks/tool_sandbox_soak.py runs 10,000
    mounts, ipc, before = Path("/proc/self/mountinfo").read_text(), host_ipc(), tool_pids()
    children_before = my_children()
    # killed at every stage: deadlines from 0 (before the keeper has forked) to past the init's start, floods, IPC
    # objects held at the kill, detached children, and calls ended by close()
    shapes = [
        "while True:\n    pass",
        "import os\nif os.fork() == 0:\n    os.setsid()\nwhile True:\n    pass",
        "print('x' * 100_000)",
        "import ctypes\nl = ctypes.CDLL(None)\nl.shmat(l.shmget(0, 65536, 0o1600), None, 0)\nwhile True:\n    pass",
    ]
    t0 = time.monotonic()
    results: dict[str, ToolResult] = {}
    for batch in range(n // 50):
        limits = ToolLimits(timeout_s=0.02 * (batch % 5), memory_mb=256, max_output_bytes=1024, ipc_kb=256)
        runner = ToolRunner(limits, workers=8)
        calls = {f"{batch}-{i}": shapes[i % len(shapes)] for i in range(50)}
        if batch % 2:  # half the batches: close() ends whatever still runs
            for k, code in calls.items():
                runner.submit(k, code)
            for _ in range(5):
                runner.poll()
                time.sleep(0.005)
            runner.close()
        else:
            got, _ = through_mailbox(runner, calls)
            runner.close()
            results.update(got)
    wall = time.monotonic() - t0
    outcomes = {o: sum(r.outcome == o for r in results.values()) for o in TOOL_OUTCOMES}
    print(f"\n[leftovers] {n} calls killed ({wall:.1f} s): {outcomes}")
    assert outcomes["tool_timeout"] + outcomes["tool_output_truncated"] >= len(results) - outcomes["tool_error"]
    deadline = time.monotonic() + 3
    while (my_children() - children_before or tool_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = my_children() - children_before
    states = {
        p: Path(f"/proc/{p}/stat").read_text().split(")")[1].split()[0] for p in left if Path(f"/proc/{p}").exists()
    }
    assert not left, f"processes of killed calls left behind (state by pid): {states}"
    assert not tool_pids() - before
    assert host_ipc() == ipc, "an IPC object of a call in the host's namespace"
    assert Path("/proc/self/mountinfo").read_text() == mounts


def test_deadline_holds_while_the_caller_does_not_poll():
    limits = ToolLimits(timeout_s=0.5, memory_mb=256, max_output_bytes=4096)
    runner = ToolRunner(limits, workers=3)
    before = tool_pids()
    calls = {
        "busy_loop": "while True:\n    pass",
        "sleeping_tree": "import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(60)",
        "holding_memory": "x = bytearray(100 * 1024**2)\nimport time\ntime.sleep(60)",
    }
    for k, code in calls.items():
        runner.submit(k, code)
    runner.poll()  # starts all three; from here the 'engine' is busy (a weight load) and does not poll
    t0 = time.monotonic()
    peak = 0
    while time.monotonic() < t0 + 3.0:
        now = len(tool_pids() - before)
        peak = max(peak, now)
        if peak >= 3 + 7 and not now:  # 3 snippets, 7 forks of the tree: all were up, and are gone
            break
        time.sleep(0.01)
    gone_after = time.monotonic() - t0
    alive = tool_pids() - before
    results: dict[str, ToolResult] = {}
    while runner.pending():
        results.update({r.call_id: r for r in runner.poll()})
        time.sleep(0.005)
    runner.close()
    table(f"deadline: {peak} processes up, all gone {gone_after:.2f} s after the start, no poll meanwhile", results)
    assert peak >= 10, peak
    assert not alive, f"calls still running {gone_after:.1f} s after a 0.5 s deadline without a poll: {alive}"
    assert gone_after < limits.timeout_s + 0.5
    check(results, {k: ("tool_timeout", "[tool killed after 0.5 s]") for k in calls})


IPC_SNIPPET = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
{body}
"""
SHM_ONE_BIG = "print('big', libc.shmget(0, 64 << 20, 0o1600), os.strerror(ctypes.get_errno()))"
SHM_MANY = """
ids = []
for i in range(64):
    r = libc.shmget(0, 64 << 10, 0o1600)
    if r < 0:
        print('refused after', len(ids) * 64, 'KiB', os.strerror(ctypes.get_errno()))
        break
    ids.append(r)
"""
MSG_FILL = """
class Msg(ctypes.Structure):
    _fields_ = [('mtype', ctypes.c_long), ('mtext', ctypes.c_char * 8192)]
m = Msg(1, b'x' * 8192)
total = 0
for q in range(64):
    qid = libc.msgget(0, 0o1600)
    if qid < 0:
        print('queues refused after', q, os.strerror(ctypes.get_errno()))
        break
    while libc.msgsnd(qid, ctypes.byref(m), 8192, 0o4000) == 0:  # IPC_NOWAIT
        total += 8192
print('held', total // 1024, 'KiB')
"""


def test_ipc_sysv_shared_memory_and_message_queues_are_bounded_by_the_call_budget():
    runner = ToolRunner(LIMITS, workers=3)
    calls = {k: IPC_SNIPPET.format(body=b) for k, b in {"shm_big": SHM_ONE_BIG, "shm_many": SHM_MANY}.items()}
    calls["msg_fill"] = IPC_SNIPPET.format(body=MSG_FILL)
    try:
        res, _ = through_mailbox(runner, calls)
    finally:
        runner.close()
    table(f"ipc (budget {LIMITS.ipc_kb} KiB)", res)
    check(
        res,
        {
            "shm_big": ("ok", "big -1 Invalid argument"),  # larger than the budget: EINVAL
            "shm_many": ("ok", f"refused after {LIMITS.ipc_kb} KiB No space left on device"),
            "msg_fill": ("ok", "queues refused after 8 No space left on device"),
        },
    )
    held = int(res["msg_fill"].output.split("held ")[1].split()[0])
    assert 0 < held <= LIMITS.ipc_kb, held  # all 8 queues together hold at most the budget


def test_rlimits_every_limit_is_set_explicitly_and_none_comes_from_the_rank():
    limits = LIMITS
    mib = 1024 * 1024
    # what each of Linux's 16 limits must be inside (soft = hard), from the ToolLimits fields by the documented rules;
    # any hard limit the rank holds lower stays lower (raising needs CAP_SYS_RESOURCE)
    want = {
        "Max cpu time": int(limits.timeout_s) + 2,
        "Max file size": limits.max_output_bytes,
        "Max data size": limits.memory_mb * mib,
        "Max stack size": 8 * mib,
        "Max core file size": 0,
        "Max resident set": limits.memory_mb * mib,
        "Max processes": limits.max_processes,
        "Max open files": limits.max_open_files,
        "Max locked memory": 0,
        "Max address space": limits.memory_mb * mib,
        "Max file locks": limits.max_open_files,
        "Max pending signals": 64,
        "Max msgqueue size": limits.ipc_kb * 1024,
        "Max nice priority": 0,
        "Max realtime priority": 0,
        "Max realtime timeout": 0,
    }
    assert len(want) == len(RLIMIT_NUMBERS) == 16
    calls = {
        "limits": "print(open('/proc/self/limits').read())",
        "sched_fifo": "import os\nos.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))",
        "nice_up": "import os\nos.nice(-5)",
        "mlock": "import ctypes, mmap, os\nm = mmap.mmap(-1, 4096)\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mlockall(3), os.strerror(ctypes.get_errno()))",
        "raise_limit": "import resource\nresource.setrlimit(resource.RLIMIT_RTPRIO, (10, 10))",
    }
    runner = ToolRunner(limits, workers=5)
    try:
        res, _ = through_mailbox(runner, calls)
    finally:
        runner.close()
    table("rlimits", res)
    check(
        res,
        {
            "limits": ("ok", "Max realtime priority"),
            "sched_fifo": ("tool_error", "PermissionError"),
            "nice_up": ("tool_error", "PermissionError"),
            "mlock": ("ok", "-1 "),
            "raise_limit": ("tool_error", "ValueError: not allowed to raise maximum limit"),
        },
    )
    inside = {}
    for line in res["limits"].output.splitlines()[1:]:
        if line.startswith("Max "):
            name = line[:26].strip()
            soft, hard = line[26:].split()[:2]
            inside[name] = (soft, hard)
    assert set(inside) == set(want), set(inside) ^ set(want)
    rank = {line[:26].strip(): line[26:].split()[1] for line in Path("/proc/self/limits").read_text().splitlines()[1:]}
    for name, value in want.items():
        cap = rank[name]
        expect = str(value if cap == "unlimited" else min(value, int(cap)))
        assert inside[name] == (expect, expect), (name, inside[name], expect)


def test_visibility_devices_read_only_proc_own_processes_no_settings_no_host_paths():
    venv = str(Path(sys.executable).parent.parent)
    calls = {
        "dev_null_times": "import os\nos.utime('/dev/null', (0, 0))",
        "dev_null_chmod": "import os\nos.chmod('/dev/zero', 0o777)",
        "dev_null_writable": "open('/dev/null', 'w').write('x' * 100)\nprint(open('/dev/zero', 'rb').read(3))",
        "proc_pids": (
            "import os, time\nif os.fork() == 0:\n    time.sleep(5)\n    os._exit(0)\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()), os.path.exists('/proc/1'))"
        ),
        "proc_no_sys": "import os\nprint(sorted(os.listdir('/proc')))",
        "cmdline": "print(repr(open('/proc/self/cmdline').read()))",
        "mountinfo": "print(open('/proc/self/mountinfo').read())",
        "venv_and_site": (
            f"import os, sys\nprint(os.path.exists({venv!r}), os.path.exists({str(ROOT)!r}), "
            "any('site-packages' in p and os.path.isdir(p) for p in sys.path))"
        ),
    }
    runner = ToolRunner(LIMITS, workers=4)
    try:
        res, _ = through_mailbox(runner, calls)
    finally:
        runner.close()
    table("visibility", res)
    check(
        res,
        {
            "dev_null_times": ("tool_error", "Read-only file system"),
            "dev_null_chmod": ("tool_error", "Read-only file system"),
            "dev_null_writable": ("ok", "b'\\x00\\x00\\x00'"),
            "proc_pids": ("ok", "'2', '3'] False"),
            "proc_no_sys": ("ok", "['2', 'self', 'thread-self']"),
            "cmdline": ("ok", "-I"),
            "mountinfo": ("ok", "/scratch"),
            "venv_and_site": ("ok", "False False False"),
        },
    )
    for k in ("cmdline", "mountinfo"):  # neither the rank's pid, the checkout nor the venv
        out = res[k].output
        assert str(ROOT) not in out and venv not in out and str(os.getpid()) not in out.split("/scratch")[0], out


def test_uid_each_call_draws_its_own_uid_not_a_pid():
    calls = {f"c{i}": "import os\nprint(os.getuid())" for i in range(8)}
    calls["ps_others"] = "import os\nprint(sorted(os.listdir('/proc')))"
    runner = ToolRunner(LIMITS, workers=9)
    try:
        res, _ = through_mailbox(runner, calls)
    finally:
        runner.close()
    table("uid", res)
    uids = [int(res[f"c{i}"].output) for i in range(8)]
    assert len(set(uids)) == 8
    assert all(UID_BASE <= u < UID_BASE + UID_SPAN for u in uids)
    # drawn, not UID_BASE + a pid (the kernel's pid_max is at most 2**22)
    assert sum(u - UID_BASE > 4 * 2**22 for u in uids) >= 6, uids
    check(res, {"ps_others": ("ok", "['2', 'self', 'thread-self']")})


# the standard library at work: what the allowlist must let through (each line a different part of the kernel)
WORKOUT = """
import json, re, math, fractions, decimal, datetime, statistics, random, hashlib, uuid, zlib, os, sys, time
import subprocess, threading, tempfile, shutil, sqlite3, mmap, select, socket, pathlib, asyncio, signal
import multiprocessing as mp, concurrent.futures as cf
print(math.factorial(20), fractions.Fraction(1, 3) + 1, decimal.Decimal('1.1') * 3, statistics.mean([1, 2]))
print(json.dumps([1]), re.sub('1', 'x', 'a1'), datetime.datetime.now().year > 2000, uuid.uuid4().hex != '')
print(random.Random(0).randint(1, 9), hashlib.sha256(b'x').hexdigest()[:4], len(zlib.compress(b'x')), os.cpu_count())
t = threading.Thread(target=time.sleep, args=(0.01,)); t.start(); t.join()
print(subprocess.run(['sh', '-c', 'echo sh; ls / | wc -l'], capture_output=True, text=True).stdout.split())
with tempfile.TemporaryDirectory() as d:
    p = pathlib.Path(d) / 'f'; p.write_text('x'); shutil.copy2(p, p.with_suffix('.b'))
    os.rename(p, p.with_suffix('.c'))
    os.symlink('f.c', pathlib.Path(d) / 'l'); os.utime(pathlib.Path(d) / 'f.c'); print(sorted(os.listdir(d)))
db = sqlite3.connect('x.db'); db.execute('create table t (x)'); db.execute('insert into t values (1)'); db.commit()
print(db.execute('select * from t').fetchall())
m = mmap.mmap(-1, 8192); m[:2] = b'ok'; print(m[:2])
a, b = socket.socketpair(); a.sendall(b'x'); print(b.recv(1), select.select([b], [], [], 0.01)[0] == [])
with mp.get_context('fork').Pool(2) as pool: print(pool.map(abs, [-1, -2]))
with cf.ThreadPoolExecutor(2) as ex: print(list(ex.map(abs, [-3])))
signal.signal(signal.SIGALRM, lambda *a: None); signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.02)
asyncio.run(asyncio.sleep(0.01)); print('done')
"""


def test_seccomp_an_unlisted_system_call_kills_with_a_named_outcome_and_the_stdlib_runs():
    libc_call = "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nprint(l.syscall({nr}, 0, 0, 0, 0, 0))"
    calls = {
        "kcmp": libc_call.format(nr=312),  # compares two processes' kernel objects: not listed
        "cachestat": libc_call.format(nr=451),  # newer than the list (Linux 6.5)
        "number_999": libc_call.format(nr=999),  # no such call yet: refused before the kernel sees it
        "x32_getpid": libc_call.format(nr=0x40000000 | 39),  # the x32 entry point
        "listed_refused_mount": (
            "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"
            "print(l.mount(b'none', b'/scratch', b'tmpfs', 0, None), os.strerror(ctypes.get_errno()))"
        ),
        "stdlib_workout": WORKOUT,
    }
    # files up to 64 kB (sqlite's database and journal), 32 processes (a pool of 2, threads)
    limits = ToolLimits(timeout_s=10.0, memory_mb=512, max_output_bytes=65536, max_processes=32)
    runner = ToolRunner(limits, workers=6)
    try:
        res, _ = through_mailbox(runner, calls)
    finally:
        runner.close()
    table("seccomp", res)
    sigsys = "signal SIGSYS (a system call the sandbox does not allow)"
    check(
        res,
        {
            "kcmp": ("tool_error", sigsys),
            "cachestat": ("tool_error", sigsys),
            "number_999": ("tool_error", sigsys),
            "x32_getpid": ("tool_error", "signal SIGSYS"),
            "listed_refused_mount": ("ok", "-1 Operation not permitted"),
            "stdlib_workout": ("ok", "done"),
        },
    )
