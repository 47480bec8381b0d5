"""What tool calls may leave on the machine, as the leftovers checks look for it (the adversarial tests and the soak
benchmark): processes running as some call's uid, and this process's children, zombies included."""

from __future__ import annotations

import os
from pathlib import Path

from pipelinerl_fsdp.tools.jail import UID_BASE


def tool_pids() -> set[int]:
    """Processes on this machine that run as some call's uid (every call's uid is at or above `UID_BASE`)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid_line = next(x for x in Path(f"/proc/{entry}/status").read_text().splitlines() if x[:4] == "Uid:")
            except (OSError, StopIteration):
                continue  # gone meanwhile
            if int(uid_line.split()[1]) >= UID_BASE:
                pids.add(int(entry))
    return pids


def my_children() -> set[int]:
    """This process's children, zombies included (every thread's list: a child belongs to the thread that made it)."""
    kids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            kids |= {int(p) for p in Path(f"/proc/self/task/{tid}/children").read_text().split()}
        except OSError:
            pass
    return kids
