"""The child side of a tool call: builds the operating-system boundary, then runs the snippet inside it.

Run by `tools/sandbox.py` as `python -I -S jail.py SETTINGS_JSON` with the snippet on stdin; it imports only the
standard library (isolated mode puts neither the project nor site-packages on the path). Three processes:

- the keeper (this process, in the rank's PID namespace): reads the snippet, dies with the rank
  (`PR_SET_PDEATHSIG`), unshares the mount, PID, network, IPC and UTS namespaces and forks the init;
- the init (PID 1 of the new namespace, still root): dies with the keeper, builds the new root (a read-only tmpfs
  with read-only binds of the interpreter's folders only, a fresh /proc, four device nodes and a size- and
  inode-capped tmpfs as the scratch folder), `pivot_root`s into it, detaches the old root, forks the snippet's
  process and reports its end to the keeper; when the init exits the kernel kills everything left in the
  namespace and frees its mounts, the scratch folder with them;
- the snippet's process: a uid of its own (`UID_BASE` + the keeper's pid, no groups, no capabilities),
  `PR_SET_NO_NEW_PRIVS`, resource limits (address space, CPU time, file size, open files, processes, no core) and
  a seccomp filter (no socket families but Unix and IP, no namespaces, mounts, ptrace, keyrings, BPF, io_uring,
  kernel modules, ...), then `exec` of the snippet.

A step that fails prints `SETUP_FAILED` and the step's name and exits with `SETUP_EXIT`: the sandbox is never
built weaker than described. Linux on x86_64, as root, only; anywhere else the first step says what is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys

SETUP_FAILED = "tool sandbox setup failed:"
SETUP_EXIT = 125
UID_BASE = 1_000_000_000  # far above any account: each call runs as UID_BASE + its keeper's pid
SCRATCH = "/scratch"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x20000000,
    0x40000000,
)
CLONE_NS_FLAGS = 0x7E020080  # every CLONE_NEW* flag, CLONE_NEWTIME included
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
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = 155  # x86_64

# seccomp: x86_64 syscall numbers refused with EPERM (a snippet has no use for any; each widens the kernel surface)
DENIED_SYSCALLS = {
    "ptrace": 101,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "acct": 163,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
SYS_SOCKET, SYS_CLONE, SYS_CLONE3 = 41, 56, 435
ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (IP reaches only the namespace's down loopback)
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97

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
    """The classic-BPF filter (struct sock_filter[]): x86_64 only, no x32 calls, the denied list, socket() only
    for Unix and IP, clone() without namespace flags, clone3() answered ENOSYS (glibc falls back to clone)."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000

    def errno(e: int) -> int:
        return 0x00050000 | e

    prog = [(ld, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]
    for nr in sorted(DENIED_SYSCALLS.values()):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno(EPERM))]
    prog += [(jeq, 0, 1, SYS_CLONE3), (ret, 0, 0, errno(ENOSYS))]
    n = len(ALLOWED_FAMILIES)
    prog += [(jeq, 0, n + 3, SYS_SOCKET), (ld, 0, 0, 16)]  # args[0], low 32 bits: the family
    prog += [(jeq, n - i, 0, fam) for i, fam in enumerate(ALLOWED_FAMILIES)]
    prog += [(ret, 0, 0, errno(EAFNOSUPPORT)), (ret, 0, 0, allow)]
    prog += [(jeq, 0, 4, SYS_CLONE), (ld, 0, 0, 16), (jset, 0, 1, CLONE_NS_FLAGS), (ret, 0, 0, errno(EPERM))]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, allow)]
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


def _install_seccomp() -> None:
    code = seccomp_program()
    buf = ctypes.create_string_buffer(code, len(code))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(code) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")


def _bind_read_only(path: str) -> None:
    """Make `path` of the old root (now under /.old) appear read-only at the same place in the new root."""
    old = "/.old" + path
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
        raise SetupError(f"read-only view: {path} does not exist")
    _mount(old, path, None, MS_BIND, None, f"read-only view: bind {path}")
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    _mount(None, path, None, flags, None, f"read-only view: remount {path} read-only")


def build_root(binds: list[str], uid: int, scratch_bytes: int, scratch_files: int) -> None:
    """In the init, as root, in the new mount and PID namespaces: the new root, entered by pivot_root."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "private mounts")
    new = "/tmp"
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=256,mode=0755", "root tmpfs")
    os.mkdir(new + "/.old")
    _check(_libc.syscall(SYS_PIVOT_ROOT, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    for path in sorted(set(binds), key=len):
        if not any(path.startswith(p.rstrip("/") + "/") for p in binds if p != path):
            _bind_read_only(path)
    os.makedirs("/dev")
    for dev in ("null", "zero", "random", "urandom"):
        open(f"/dev/{dev}", "w").close()  # noqa: SIM115
        _mount(f"/.old/dev/{dev}", f"/dev/{dev}", None, MS_BIND, None, f"device /dev/{dev}")
    os.symlink("/proc/self/fd", "/dev/fd")
    os.mkdir("/proc")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "fresh /proc")
    os.mkdir(SCRATCH)
    opts = f"size={scratch_bytes},nr_inodes={scratch_files},mode=0700,uid={uid},gid={uid}"
    _mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, opts, "scratch tmpfs")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "root read-only")
    os.chdir(SCRATCH)


def confine(uid: int, limits: dict[str, int]) -> None:
    """In the snippet's process: limits, its own uid without groups or capabilities, no new privileges, seccomp."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # every uid non-zero: the kernel clears all capabilities
    if os.getuid() != uid or os.geteuid() != uid:
        raise SetupError("drop to the call's uid")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _install_seccomp()


def _exit_status(status: int) -> bytes:
    if os.WIFSIGNALED(status):
        return b"S%d" % os.WTERMSIG(status)
    return b"E%d" % os.waitstatus_to_exitcode(status)


def _init(settings: dict, code: str, report: int) -> None:
    """PID 1: build the root, run the snippet's process, reap every orphan, report the snippet's end."""
    uid = settings["uid_base"] + settings["keeper_pid"]
    build_root(settings["binds"], uid, settings["scratch_bytes"], settings["scratch_files"])
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report)
            confine(uid, settings["limits"])
        except (SetupError, OSError) as e:
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


def main() -> None:
    """The keeper: see the module docstring."""
    settings = json.loads(sys.argv[1])
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "die with the rank")
        if os.getppid() != settings["rank_pid"]:
            os._exit(SETUP_EXIT)  # the rank died before the line above
        code = sys.stdin.read()
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
        os._exit(SETUP_EXIT)
    settings["keeper_pid"] = os.getpid()
    read_end, write_end = os.pipe()
    alive_r, alive_w = os.pipe()  # held open by the keeper only: it hangs up when the keeper dies
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.close(alive_w)
        try:
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "init dies with the keeper")
            hung_up = select.poll()
            hung_up.register(alive_r, select.POLLHUP)
            if hung_up.poll(0):  # the keeper died before the line above (its pid is not visible from here)
                os._exit(SETUP_EXIT)
            os.close(alive_r)
            _init(settings, code, write_end)
        except (SetupError, OSError) as e:
            print(SETUP_FAILED, e, flush=True)
            os._exit(SETUP_EXIT)
        os._exit(SETUP_EXIT)
    os.close(write_end)
    os.close(alive_r)
    end = os.read(read_end, 64)
    _, status = os.waitpid(pid, 0)
    if not end:  # the init died before the snippet ended: a setup step (it printed which) or a kill
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else SETUP_EXIT)
    if end[:1] == b"S":  # end the keeper as the snippet ended, so the runner names the signal
        sig = int(end[1:])
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(int(end[1:]))


if __name__ == "__main__":
    main()
