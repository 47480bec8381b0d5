"""Per-token versions from the vLLM engine's update boundaries, and the process clean-up of a failing rank."""

import subprocess
import sys
import time

from pipelinerl_fsdp.inference.vllm_engine import versions_from_segments
from pipelinerl_fsdp.runtime.processes import descendants, kill_descendants


def test_versions_follow_the_boundaries():
    # added under v3; update to v4 after 2 tokens, to v5 after 5
    assert versions_from_segments([(0, 3), (2, 4), (5, 5)], 7) == [3, 3, 4, 4, 4, 5, 5]


def test_a_request_not_scheduled_at_an_update_is_all_new():
    assert versions_from_segments([(0, 3), (0, 4)], 3) == [4, 4, 4]


def test_an_update_after_the_last_token_changes_nothing():
    assert versions_from_segments([(0, 1), (4, 2)], 4) == [1, 1, 1, 1]
    assert versions_from_segments([(0, 1)], 0) == []


def test_stopping_children_kills_the_whole_subtree():
    # a child that starts a grandchild, as vLLM's engine core starts its workers
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    )
    deadline = time.time() + 10
    while len(descendants(child.pid)) < 1 and time.time() < deadline:
        time.sleep(0.05)
    grandchildren = descendants(child.pid)
    assert grandchildren, "the grandchild did not start"
    kill_descendants()
    assert child.wait(timeout=10) != 0
    for pid in grandchildren:
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break  # gone
            if state == "Z":  # killed, waiting to be reaped by init
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"grandchild {pid} still running")
