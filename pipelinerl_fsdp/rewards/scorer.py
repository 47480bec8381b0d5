"""Scorers: how the inference loop turns finished completions into (reward, outcome) without blocking on them.

`InlineScorer` calls a task's cheap, exact reward right away; `PoolScorer` hands answers to a `RewardPool` and
returns them as they complete. Either way a completion that hit the token budget without a stop token is
reported as `truncated` (its reward is still the function's).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

from pipelinerl_fsdp.rewards.outcomes import outcome_for
from pipelinerl_fsdp.rewards.pool import RewardPool


class Scorer(Protocol):
    def submit(self, key: Hashable, completion: str, gold: str, finished: bool) -> None: ...

    def ready(self) -> list[tuple[Hashable, float, str]]:
        """(key, reward, outcome) of every answer scored since the last call; never blocks."""
        ...

    def close(self) -> None: ...


class InlineScorer:
    def __init__(self, reward: Callable[[str, str], float]) -> None:
        self.reward = reward
        self._done: list[tuple[Hashable, float, str]] = []

    def submit(self, key: Hashable, completion: str, gold: str, finished: bool) -> None:
        r = self.reward(completion, gold)
        self._done.append((key, r, outcome_for(r, finished)))

    def ready(self) -> list[tuple[Hashable, float, str]]:
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        pass


class PoolScorer:
    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self._truncated: set[Hashable] = set()

    def submit(self, key: Hashable, completion: str, gold: str, finished: bool) -> None:
        if not finished:
            self._truncated.add(key)
        self.pool.submit(key, completion, gold)

    def ready(self) -> list[tuple[Hashable, float, str]]:
        out = []
        for key, reward, outcome in self.pool.poll():
            if key in self._truncated:
                self._truncated.discard(key)
                outcome = "truncated"
            out.append((key, reward, outcome))
        return out

    def close(self) -> None:
        self.pool.close()
