"""The child side of a tool call: builds the operating-system boundary, then runs the snippet inside it.

Run by `tools/sandbox.py` as `python -I -S -c LOADER`, everything else on stdin: this file's source (the loader
compiles it, so no path of the checkout appears in any process's command line), one line of settings (JSON), then
the snippet. It imports only the standard library. Three processes:

- the keeper (this process, in the rank's PID namespace): dies with the rank (`PR_SET_PDEATHSIG`), unshares the
  mount, PID, network, IPC and UTS namespaces, forks the init and waits for the first of: the snippet's end (the
  init reports it), the init's own death, the call's deadline (its own timer: the deadline holds even when the
  caller stops polling), or SIGTERM (the caller ending the call). It then kills the init if it still runs, reaps
  it (so no zombie is left behind) and writes one JSON line naming the end on the status pipe (`status_fd`);
- the init (PID 1 of the new namespace, still root): dies with the keeper, sets the namespace's SysV IPC limits,
  builds the new root (a read-only tmpfs with read-only binds of the system's folders and the interpreter's
  standard library, a `/proc` that shows only the call's own processes, four read-only device nodes, a
  `/dev/shm` of the IPC budget and a size- and inode-capped tmpfs as the scratch folder), `pivot_root`s into it,
  detaches the old root, forks the snippet's process and reports its end to the keeper; when the init exits the
  kernel kills everything left in the namespace and frees its mounts and IPC objects, the scratch folder with them;
- the snippet's process: the call's uid (no groups, no capabilities), every resource limit set explicitly,
  `PR_SET_NO_NEW_PRIVS`, the seccomp filter the caller passed, then the snippet.

A step that fails prints `SETUP_FAILED` and the step's name: the sandbox is never built weaker than described.
Linux on x86_64, as root, only; anywhere else the first step says what is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

SETUP_FAILED = "tool sandbox setup failed:"
SETUP_EXIT = 125
# A call's uid is drawn at random from [UID_BASE, UID_BASE + UID_SPAN): far above any account, below 2**32 - 1
UID_BASE = 1_000_000_000
UID_SPAN = 3_000_000_000
SCRATCH = "/scratch"
# the loader `tools/sandbox.py` passes with -c: reads this file's source (length-prefixed) from stdin and runs it
LOADER = "import sys;b=sys.stdin.buffer;exec(compile(b.read(int(b.readline())),'jail','exec'))"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = 155  # x86_64
# every resource limit of Linux (include/uapi/asm-generic/resource.h), by name; Python's module lacks RLIMIT_LOCKS
RLIMIT_NUMBERS = {
    "RLIMIT_CPU": 0,
    "RLIMIT_FSIZE": 1,
    "RLIMIT_DATA": 2,
    "RLIMIT_STACK": 3,
    "RLIMIT_CORE": 4,
    "RLIMIT_RSS": 5,
    "RLIMIT_NPROC": 6,
    "RLIMIT_NOFILE": 7,
    "RLIMIT_MEMLOCK": 8,
    "RLIMIT_AS": 9,
    "RLIMIT_LOCKS": 10,
    "RLIMIT_SIGPENDING": 11,
    "RLIMIT_MSGQUEUE": 12,
    "RLIMIT_NICE": 13,
    "RLIMIT_RTPRIO": 14,
    "RLIMIT_RTTIME": 15,
}
RLIM_NLIMITS = 16

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the boundary could not be built."""


def _check(ret: int, step: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(errno)} (errno {errno})")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None, step: str) -> None:
    enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), step)


def seccomp_program() -> bytes:
    """The seccomp filter a call's process gets (tools/seccomp_policy.py: an allowlist built by libseccomp), as
    BPF bytes. Called in the rank, never inside the jail, which receives the bytes."""
    from pipelinerl_fsdp.tools.seccomp_policy import filter_program

    return filter_program()


def _install_seccomp(code: bytes) -> None:
    if not code or len(code) % 8:
        raise SetupError(f"seccomp filter: {len(code)} bytes is not a BPF program")
    buf = ctypes.create_string_buffer(code, len(code))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(code) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")


def _bind_read_only(path: str, old: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    """Make `old` (a path of the old root, now under /.old) appear read-only at `path` in the new root."""
    if os.path.islink(old):  # /bin -> usr/bin on merged-/usr systems: the same link
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        os.symlink(os.readlink(old), path)
        return
    if os.path.isdir(old):
        os.makedirs(path, exist_ok=True)
    elif os.path.exists(old):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()  # noqa: SIM115 (an empty file to bind onto)
    else:
        raise SetupError(f"read-only view: {path[len('/.old') :] if path.startswith('/.old') else path} does not exist")
    _mount(old, path, None, MS_BIND, None, f"read-only view: bind {path}")
    # a bind inherits the source's flags; read-only needs a second, remounting call
    _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags, None, f"read-only view: remount {path}")


# SysV IPC of the namespace (per IPC namespace, written by the init before the snippet runs): a handful of objects
# whose bytes, in all, are `ipc_bytes`; the kernel frees them with the namespace.
def ipc_sysctls(ipc_bytes: int) -> dict[str, str]:
    """The namespace's /proc/sys values for an IPC budget of `ipc_bytes` (shared memory and message queues each)."""
    pages = max(1, ipc_bytes // 4096)
    queue = max(1024, ipc_bytes // 8)
    return {
        "kernel/shmmax": str(pages * 4096),  # the largest segment
        "kernel/shmall": str(pages),  # every segment together, in pages
        "kernel/shmmni": "8",
        "kernel/shm_rmid_forced": "1",  # a segment no process holds is freed at once
        "kernel/msgmni": "8",  # queues
        "kernel/msgmnb": str(queue),  # bytes per queue: 8 queues hold at most ipc_bytes
        "kernel/msgmax": str(min(8192, queue)),
        "kernel/sem": "32 256 32 8",  # per set, in all, per call, sets
        "fs/mqueue/queues_max": "8",  # POSIX queues (their bytes: RLIMIT_MSGQUEUE)
    }


def build_root(settings: dict) -> None:
    """In the init, as root, in the new mount, PID and IPC namespaces: the IPC limits, then the new root, entered
    by pivot_root."""
    uid = settings["uid"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "private mounts")
    new = "/tmp"
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=256,mode=0755", "root tmpfs")
    os.mkdir(new + "/.old")
    _check(_libc.syscall(SYS_PIVOT_ROOT, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    binds = settings["binds"]
    for path in sorted(set(binds), key=len):
        if not any(path.startswith(p.rstrip("/") + "/") for p in binds if p != path):
            _bind_read_only(path, "/.old" + path)
    os.makedirs("/dev")
    for dev in ("null", "zero", "random", "urandom"):  # read-only binds: usable, but their inodes unchangeable
        _bind_read_only(f"/dev/{dev}", f"/.old/dev/{dev}", MS_NOSUID | MS_NOEXEC)
    os.symlink("/proc/self/fd", "/dev/fd")
    os.mkdir("/dev/shm")  # POSIX shared memory and semaphores (multiprocessing's locks), within the IPC budget
    opts = f"size={settings['ipc_bytes']},nr_inodes=64,mode=1777"
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts, "/dev/shm tmpfs")
    os.mkdir("/proc")
    # a full /proc of the new namespaces first, for the IPC limits (its sys/ is hidden from the snippet's)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "fresh /proc")
    for key, value in ipc_sysctls(settings["ipc_bytes"]).items():
        try:
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(value)
        except OSError as e:
            raise SetupError(f"IPC limit {key}: {e.strerror}") from e
    _check(_libc.umount2(b"/proc", 0), "unmount the full /proc")
    # what the snippet sees: its own processes only (not the init's, whose memory holds the settings), no sys/
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount("proc", "/proc", "proc", flags, "hidepid=invisible,subset=pid", "/proc of the call's own processes")
    except SetupError:  # kernels before 5.8 know neither option by name: hidepid=2 is the same hiding (no subset)
        _mount("proc", "/proc", "proc", flags, "hidepid=2", "/proc of the call's own processes")
    os.mkdir(SCRATCH)
    opts = f"size={settings['scratch_bytes']},nr_inodes={settings['scratch_files']},mode=0700,uid={uid},gid={uid}"
    _mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, opts, "scratch tmpfs")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "root read-only")
    os.chdir(SCRATCH)


def confine(uid: int, limits: dict[str, int], seccomp: bytes) -> None:
    """In the snippet's process: every limit, its own uid without groups or capabilities, no new privileges,
    seccomp."""
    numbers = {RLIMIT_NUMBERS[name]: value for name, value in limits.items()}
    missing = sorted(set(range(RLIM_NLIMITS)) - set(numbers))
    if missing:  # never inherit one from the rank (a raised `ulimit -r` would allow SCHED_FIFO)
        raise SetupError(f"limits: no value for resource(s) {missing}")
    for number, value in numbers.items():
        hard = resource.getrlimit(number)[1]
        if hard != resource.RLIM_INFINITY:  # never above the rank's own (raising needs CAP_SYS_RESOURCE)
            value = min(value, hard)
        try:
            resource.setrlimit(number, (value, value))
        except (OSError, ValueError) as e:
            raise SetupError(f"limit {number} = {value}: {e}") from e
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # every uid non-zero: the kernel clears all capabilities
    if os.getuid() != uid or os.geteuid() != uid:
        raise SetupError("drop to the call's uid")
    # a uid change makes a process undumpable, which hides it from its own siblings in /proc (no cores: RLIMIT_CORE)
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _install_seccomp(seccomp)


def _exit_status(status: int) -> bytes:
    if os.WIFSIGNALED(status):
        return b"S%d" % os.WTERMSIG(status)
    return b"E%d" % os.waitstatus_to_exitcode(status)


def _init(settings: dict, code: str, report: int) -> None:
    """PID 1: build the root, run the snippet's process, reap every orphan, report the snippet's end."""
    uid = settings["uid"]
    build_root(settings)
    seccomp = bytes.fromhex(settings["seccomp"])
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report)
            confine(uid, settings["limits"], seccomp)
        except Exception as e:  # noqa: BLE001 (any failed step ends the call, named; nothing of the host printed)
            print(SETUP_FAILED, e, flush=True)
            os._exit(SETUP_EXIT)
        os.environ.clear()
        os.environ.update(PATH="/usr/bin:/bin", HOME=SCRATCH, TMPDIR=SCRATCH, PYTHONHASHSEED="0")
        del settings, report
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
        except SystemExit:
            raise
        except BaseException as e:  # the snippet's error, printed as an uncaught one would be, from its own frames
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
            sys.excepthook(type(e), e.with_traceback(tb), tb)
            sys.stdout.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    while True:  # as init, every orphan of the namespace is ours to reap
        got, status = os.waitpid(-1, 0)
        if got == pid:
            os.write(report, _exit_status(status))
            os._exit(0)  # the kernel kills what the snippet left running


def _describe(status: int) -> dict:
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"code": os.waitstatus_to_exitcode(status)}


def _report(fd: int, end: dict) -> None:
    try:
        os.write(fd, json.dumps(end).encode() + b"\n")
    except OSError:  # the caller has already ended the call and closed its end
        pass


def _start_init(settings: dict, code: str, report_w: int, alive_r: int) -> None:
    """In the forked init, before anything of the snippet: die with the keeper, keep only the fds it needs."""
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "init dies with the keeper")
        hung_up = select.poll()
        hung_up.register(alive_r, select.POLLHUP)
        if hung_up.poll(0):  # the keeper died before the line above (its pid is not visible from here)
            os._exit(SETUP_EXIT)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(report_w, 3)  # the report pipe as fd 3; every other inherited fd (the status pipe) closed
        os.closerange(4, 1 << 16)
        _init(settings, code, 3)
    except Exception as e:  # noqa: BLE001 (any failed step ends the call, named; nothing of the host printed)
        print(SETUP_FAILED, e, flush=True)
        os._exit(SETUP_EXIT)
    os._exit(SETUP_EXIT)


def main() -> None:
    """The keeper: see the module docstring."""
    # the caller ends a call with SIGTERM; handled in the loop below (wake-up fd), so the init is always reaped
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: None)
    stdin = sys.stdin.buffer
    settings = json.loads(stdin.readline())
    status_fd = settings["status_fd"]
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "die with the rank")
        if os.getppid() != settings["rank_pid"]:
            os._exit(SETUP_EXIT)  # the rank died before the line above
        code = stdin.read().decode(errors="replace")
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        machine = os.uname().machine
        if sys.platform != "linux" or machine != "x86_64":
            raise SetupError(f"{sys.platform}/{machine}: only Linux on x86_64 is supported (seccomp's syscall table)")
        if os.geteuid() != 0:
            raise SetupError(f"namespaces and a uid per call need root (the job runs as uid {os.geteuid()})")
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        _check(_libc.unshare(flags), "unshare mount/PID/network/IPC/UTS namespaces")
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except SetupError as e:
        print(SETUP_FAILED, e, flush=True)
        _report(status_fd, {"end": "setup", "step": str(e)})
        os._exit(SETUP_EXIT)
    read_end, write_end = os.pipe()
    alive_r, alive_w = os.pipe()  # held open by the keeper only: it hangs up when the keeper dies
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.close(alive_w)
        _start_init(settings, code, write_end, alive_r)
    os.close(write_end)
    os.close(alive_r)
    waiting = select.poll()
    waiting.register(read_end, select.POLLIN | select.POLLHUP)
    waiting.register(wake_r, select.POLLIN)
    end: dict = {}
    while not end:
        left = settings["deadline"] - time.monotonic()
        if left <= 0:
            end = {"end": "timeout"}
            break
        ready = {fd for fd, _ in waiting.poll(max(1, int(left * 1000) + 1))}
        if wake_r in ready and signal.SIGTERM in _signals(wake_r):
            end = {"end": "ended"}
        elif read_end in ready:
            got = os.read(read_end, 64)
            end = {"end": "snippet", "how": got.decode()} if got else {"end": "init"}
    if end["end"] != "snippet":
        os.kill(pid, signal.SIGKILL)  # our unreaped child: its pid cannot have been reused
    _, status = os.waitpid(pid, 0)  # returns once every process of the namespace is gone
    if end["end"] == "init":  # the init died before the snippet ended: a setup step (it printed which) or a kill
        end.update(_describe(status))
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == SETUP_EXIT:
            end["end"] = "setup"
    _report(status_fd, end)
    os._exit(0)


def _signals(wake_r: int) -> set[int]:
    try:
        return set(os.read(wake_r, 64))
    except BlockingIOError:
        return set()


if __name__ == "__main__":
    main()
