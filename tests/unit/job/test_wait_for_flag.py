"""The engines' wait for the warm start (job.world.wait_for_flag): it ends within a fraction of a second when a
peer reports a failure (with that failure's cause) and when a signal arrives, instead of blocking in the store
until torchrun's SIGKILL."""

from __future__ import annotations

import datetime
import signal
import threading
import time

import pytest
import torch.distributed as dist

from pipelinerl_fsdp.job.world import wait_for_flag


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def test_a_peer_failure_ends_the_wait_with_its_cause(store: dist.TCPStore):
    threading.Timer(0.3, lambda: store.set("failed", "rank 0, warm start: OSError: disk full")).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a peer failed before setting 'done': rank 0, warm start: OSError: disk"):
        wait_for_flag(store, "done", "failed", poll_s=0.05)
    assert time.monotonic() - t0 < 1.0


def test_the_flag_ends_the_wait(store: dist.TCPStore):
    threading.Timer(0.2, lambda: store.set("done", "1")).start()
    t0 = time.monotonic()
    wait_for_flag(store, "done", "failed", poll_s=0.05)
    assert 0.2 <= time.monotonic() - t0 < 1.0


class Stop(Exception):
    pass


def test_a_signal_is_handled_during_the_wait(store: dist.TCPStore):
    """Python runs a signal's handler between two checks (torchrun's SIGTERM stands behind this SIGALRM); a blocking
    store.wait would hold it off until the store's own timeout."""

    def handler(signum, frame):
        raise Stop

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.monotonic()
        with pytest.raises(Stop):
            wait_for_flag(store, "done", "failed", poll_s=0.2)
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
