"""The tool sandbox's seccomp policy: an allowlist, built into a BPF program by libseccomp.

A snippet's process may make only the system calls below, grouped by why a Python interpreter running the standard
library (and the shell and programs of /usr it may start) needs them. They were checked against an strace of the
snippets' processes (after their filter was installed, children included) running both adversarial suites of
tests/unit/tools, the tool task's sums and a standard-library workout (threads, subprocess, a multiprocessing pool,
sqlite3, mmap, sockets, asyncio, timers): 91 distinct calls, every one listed. Anything else kills the snippet's
process with SIGSYS, which the runner names ('a system call the sandbox does not allow'): a call the kernel adds
tomorrow is refused until it is listed here.

A few calls are refused with an error instead of a kill, so that code probing for them fails the ordinary way:
the kernel surface a snippet never needs (mounts, namespaces, ptrace, BPF, io_uring, keyrings, modules, ...:
EPERM), socket families other than Unix and IP (EAFNOSUPPORT), clone with a namespace flag (EPERM) and clone3
(ENOSYS: glibc then falls back to clone, whose flags a filter can read; clone3 passes them in memory).

libseccomp (libseccomp.so.2, part of every Debian/Ubuntu install: apt and systemd link it) builds the program: it
adds the architecture check (x86_64 only, x32 and i386 entry points killed) and orders the rules. The filter is
built once per rank and handed to each call's jail as bytes; the jail itself never loads the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# fmt: off
ALLOWED: dict[str, tuple[str, ...]] = {
    # why: the interpreter's memory (allocator arenas, mmap'd modules, thread stacks)
    "memory": ("brk", "mmap", "munmap", "mprotect", "mremap", "madvise", "msync", "mincore", "mlock", "mlock2",
               "munlock", "mlockall", "munlockall", "membarrier"),  # mlock*: refused by RLIMIT_MEMLOCK = 0
    # why: files, in the read-only root and the scratch folder
    "files": ("read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
              "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "stat", "fstat", "lstat",
              "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink",
              "readlinkat", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir",
              "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
              "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
              "utimensat", "futimesat", "truncate", "ftruncate", "fallocate", "fadvise64", "fsync", "fdatasync",
              "sync", "syncfs", "sync_file_range", "flock", "fcntl", "dup", "dup2", "dup3", "umask", "sendfile",
              "copy_file_range", "splice", "tee", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr",
              "flistxattr", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
              "ioctl", "memfd_create", "mknod", "mknodat"),  # memfd: bounded by RLIMIT_FSIZE; mknod: EPERM, no caps
    # why: waiting and time (select, sleep, threading's locks, subprocess's pipes)
    "events": ("poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
               "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "pipe", "pipe2", "futex", "futex_waitv",
               "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time", "times",
               "alarm", "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun",
               "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime", "pause", "sched_yield",
               "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch", "restart_syscall"),
    # why: processes and threads (subprocess, os.fork, multiprocessing, threading); clone's flags are checked
    "processes": ("fork", "vfork", "execve", "execveat", "wait4", "waitid", "exit", "exit_group", "getpid",
                  "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid", "set_tid_address",
                  "set_robust_list", "get_robust_list", "rseq", "arch_prctl", "prctl", "uname", "sysinfo",
                  "getrusage", "getrlimit", "setrlimit", "prlimit64", "getpriority", "setpriority",
                  "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam", "sched_getscheduler",
                  "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
                  "getcpu", "getrandom", "capget", "capset"),  # setpriority/setscheduler: limited by NICE/RTPRIO = 0
    # why: its identity (reads; the set* calls answer EPERM: no capabilities)
    "identity": ("getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
                 "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid"),
    # why: signals (its own processes only: a PID namespace)
    "signals": ("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait",
                "rt_sigqueueinfo", "rt_tgsigqueueinfo", "rt_sigsuspend", "sigaltstack", "kill", "tkill", "tgkill",
                "signalfd", "signalfd4", "pidfd_open", "pidfd_send_signal"),
    # why: sockets inside the namespace (socketpair, loopback); socket()'s family is checked
    "sockets": ("socketpair", "bind", "listen", "connect", "accept", "accept4", "sendto", "recvfrom", "sendmsg",
                "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "getsockname", "getpeername", "setsockopt",
                "getsockopt"),
    # why: IPC, bounded by the namespace's limits (jail.ipc_sysctls) and RLIMIT_MSGQUEUE
    "ipc": ("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
            "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
            "mq_getsetattr"),
}
# fmt: on

# refused with EPERM rather than killed: the kernel surface a snippet never needs
REFUSED = (
    "ptrace", "mount", "umount2", "pivot_root", "chroot", "swapon", "swapoff", "reboot", "acct", "init_module",
    "delete_module", "quotactl", "kexec_load", "add_key", "request_key", "keyctl", "unshare", "perf_event_open",
    "name_to_handle_at", "open_by_handle_at", "setns", "process_vm_readv", "process_vm_writev", "finit_module",
    "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
)  # fmt: skip
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (IP reaches only the namespace's down loopback)
CLONE_NS_FLAGS = 0x7E020080  # every CLONE_NEW* flag, CLONE_NEWTIME included
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97

_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_CMP_EQ, _CMP_GT, _CMP_MASKED_EQ = 4, 6, 7


def _errno(e: int) -> int:
    return 0x00050000 | e


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused the policy."""


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(f"libseccomp ({name}: apt-get install libseccomp2): {e}") from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def filter_program() -> bytes:
    """The policy as a classic-BPF program (struct sock_filter[]), for the jail's prctl(PR_SET_SECCOMP)."""
    lib = _library()
    ctx = lib.seccomp_init(_KILL_PROCESS)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:

        def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a call of this architecture (libseccomp knows every x86_64 name)
                raise SeccompUnavailable(f"libseccomp does not know the system call {name!r}")
            arr = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
            ret = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if ret < 0:
                raise SeccompUnavailable(f"seccomp rule for {name}: {os.strerror(-ret)}")

        for names in ALLOWED.values():
            for name in names:
                rule(_ALLOW, name)
        for name in REFUSED:
            rule(_errno(EPERM), name)
        rule(_errno(ENOSYS), "clone3")
        for fam in SOCKET_FAMILIES:
            rule(_ALLOW, "socket", (0, _CMP_EQ, fam, 0))
        others = [(0, _CMP_EQ, fam, 0) for fam in range(max(SOCKET_FAMILIES)) if fam not in SOCKET_FAMILIES]
        for cmp in [*others, (0, _CMP_GT, max(SOCKET_FAMILIES), 0)]:
            rule(_errno(EAFNOSUPPORT), "socket", cmp)
        rule(_ALLOW, "clone", (0, _CMP_MASKED_EQ, CLONE_NS_FLAGS, 0))
        for bit in range(64):
            if CLONE_NS_FLAGS >> bit & 1:
                rule(_errno(EPERM), "clone", (0, _CMP_MASKED_EQ, 1 << bit, 1 << bit))
        r, w = os.pipe()
        try:
            ret = lib.seccomp_export_bpf(ctx, w)
            os.close(w)
            w = -1
            if ret < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf: {os.strerror(-ret)}")
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)


def listed() -> set[str]:
    """Every system call the policy names (allowed or refused with an error)."""
    return {n for names in ALLOWED.values() for n in names} | set(REFUSED) | {"clone", "clone3", "socket"}
