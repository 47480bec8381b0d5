"""Binding a rank to its cores: every thread of the process, not only the calling one (Linux affinity is per
thread, and gloo's I/O loops are running before a rank binds)."""

from __future__ import annotations

import os
import threading
from unittest import mock

import pytest

from pipelinerl_fsdp.runtime import cpu_binding

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"), reason="needs Linux affinity"
)


@linux_only
def test_bind_reaches_threads_started_before_it_and_after() -> None:
    original = sorted(os.sched_getaffinity(0))
    target = {original[-1]}
    release, started = threading.Event(), threading.Event()
    later: list[set[int]] = []

    def early() -> None:  # like gloo's loop: running before the rank binds
        started.set()
        release.wait(30)

    def spawn_later() -> None:
        t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        t.start()
        t.join()

    worker = threading.Thread(target=early, daemon=True)
    worker.start()
    started.wait(30)
    try:
        assert os.sched_getaffinity(worker.native_id) == set(original)
        assert cpu_binding.bind(sorted(target))
        assert os.sched_getaffinity(0) == target
        assert os.sched_getaffinity(worker.native_id) == target  # the thread that was already running
        spawn_later()
        assert later == [target]  # a thread started afterwards inherits the binding
    finally:
        release.set()
        worker.join(30)
        cpu_binding.bind(original)
    assert os.sched_getaffinity(0) == set(original)


@linux_only
def test_bind_skips_a_thread_that_ended_meanwhile() -> None:
    original = sorted(os.sched_getaffinity(0))
    gone = 2**22 + 12345  # above any default pid_max: no such thread
    try:
        with mock.patch.object(cpu_binding, "_thread_ids", return_value={threading.get_native_id(), gone}):
            assert cpu_binding.bind([original[0]])
        assert os.sched_getaffinity(0) == {original[0]}
    finally:
        cpu_binding.bind(original)


def test_bind_reports_an_os_that_refuses() -> None:
    with mock.patch.object(os, "sched_setaffinity", side_effect=OSError(22, "Invalid argument"), create=True):
        assert cpu_binding.bind([0]) is False
