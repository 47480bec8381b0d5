"""Reward functions for the reward-pool tests (imported by the pool's spawned workers by dotted path)."""

import os
import time


def misbehave(completion: str, gold: str):
    if completion == "HANG":
        time.sleep(3600)
    if completion == "CRASH":
        os._exit(3)  # like an out-of-memory kill: no exception, the process is gone
    if completion == "RAISE":
        raise RuntimeError("the reward function failed")
    if completion == "TUPLE":
        return 0.5, "no_answer"
    return float(completion.strip() == gold)


NOT_CALLABLE = 3
