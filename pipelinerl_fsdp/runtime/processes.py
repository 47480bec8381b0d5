"""The process tree as Linux's /proc shows it: what a rank uses to take its vLLM processes down with it, and what
vLLM's worker uses to notice that its rank is gone."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid`, or None when it cannot be read (the process is gone, or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (empty where there is none, or no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_descendants() -> None:
    """SIGKILL every process this one started (vLLM's engine core and, below it, its workers): otherwise they
    outlive a failed rank (measured: an orphaned vLLM worker kept spinning at 100% CPU) and hold the job's
    output pipes open, so that whoever waits on the launcher's output hangs."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
