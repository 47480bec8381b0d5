"""On the first trainer rank: assembles each optimizer step's batch of whole groups from the rollout receiver.

Rules (the pure parts are functions below, unit-tested):
- a group is stale when its oldest token is more than `rl.max_lag` versions behind the trainer; stale groups are
  dropped whole (their advantages were computed over the whole group), and counted in samples and groups;
- with `rl.filter_zero_advantage`, groups whose attempts all scored the same are dropped (and counted);
- groups left over after a batch is full wait for the next step and are checked for staleness again then;
- conventional mode: the whole round of `rl.sync_every` batches is collected at the round's first step (the
  engines generate it all with one version, then idle), shuffled with the job's seeded generator and handed out
  one batch per step. Unshuffled, the round's first step would get the shortest groups (they arrive first) and its
  last step the longest, always at lag G-1.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipelinerl_fsdp.config import RLConfig
from pipelinerl_fsdp.rl.advantages import is_zero_advantage_group
from pipelinerl_fsdp.runtime import stopping
from pipelinerl_fsdp.runtime.stopping import StopRequested
from pipelinerl_fsdp.samples import EngineStats, EvalReport, Sample, model_versions

Group = list[Sample]


class GroupSource(Protocol):
    """What the collector reads from (the rollout receiver; a fake in unit tests)."""

    def get(self, timeout: float) -> tuple[int, Group | EvalReport, EngineStats] | None: ...

    def qsize(self) -> int: ...

    def finished(self) -> bool: ...


def group_lag(group: Group, version: int) -> int:
    """Versions between the trainer's `version` and the group's oldest sampled token."""
    return version - min((v for s in group for v in model_versions(s.versions)), default=version)


def shuffled_round(groups: list[Group], rng: random.Random) -> list[Group]:
    """A conventional round's groups in an order drawn from `rng` (a permutation: the same groups, each once)."""
    out = list(groups)
    rng.shuffle(out)
    return out


def split_stale(groups: list[Group], version: int, max_lag: int) -> tuple[list[Group], list[Group]]:
    """(fresh groups, stale groups) at trainer version `version`, order kept."""
    fresh = [g for g in groups if group_lag(g, version) <= max_lag]
    stale = [g for g in groups if group_lag(g, version) > max_lag]
    return fresh, stale


@dataclass
class CollectorCounts:
    dropped_samples: int = 0
    dropped_groups: int = 0
    filtered_samples: int = 0
    filtered_groups: int = 0
    nonfinite_samples: int = 0  # dropped with their group: an engine returned a NaN/inf log-prob


@dataclass
class Collector:
    source: GroupSource
    rl: RLConfig
    n_engines: int
    # orders each conventional round (seeded by the job: `job.seed`)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    counts: CollectorCounts = field(default_factory=CollectorCounts)
    buffer: list[Group] = field(default_factory=list)
    engine_stats: dict[int, EngineStats] = field(default_factory=dict)
    pause_max: dict[int, float] = field(default_factory=dict)
    # inference index -> newest group id received from it (for the prompt streams' resume positions)
    max_gid: dict[int, int] = field(default_factory=dict)
    _round: list[Group] = field(default_factory=list)  # conventional: the groups of the round not yet trained
    # evaluation reports that arrived with the rollouts (never trained on), for the trainer to log
    eval_reports: list[EvalReport] = field(default_factory=list)

    def stream_next(self) -> dict[str, int]:
        """Per inference index, the prompt-stream position after the newest group received (for resume)."""
        return {str(k): v + self.n_engines for k, v in self.max_gid.items()}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from (JSON; the trainer checkpoint's meta holds it): the counts and, per
        inference index, the prompt-stream position after the newest group received (`stream_next`, which the
        engines resume from). Groups received but not yet trained on are not part of it: the engines continue
        after them, so a resumed run never trains on them."""
        c = self.counts
        return {
            "dropped_stale": c.dropped_samples,
            "dropped_stale_groups": c.dropped_groups,
            "filtered_zero_adv": c.filtered_samples,
            "filtered_zero_adv_groups": c.filtered_groups,
            "dropped_nonfinite": c.nonfinite_samples,
            "stream_next": self.stream_next(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `state_dict()`; keys an older checkpoint lacks count from 0)."""
        self.counts = CollectorCounts(
            state["dropped_stale"],
            state.get("dropped_stale_groups", 0),
            state.get("filtered_zero_adv", 0),
            state.get("filtered_zero_adv_groups", 0),
            state.get("dropped_nonfinite", 0),
        )
        self.max_gid = {int(k): v - self.n_engines for k, v in state["stream_next"].items()}

    def queued_samples(self) -> int:
        return self.source.qsize() * self.rl.attempts + sum(len(g) for g in self.buffer)

    def next_batch(self, version: int, timeout_s: float, groups: int = 0) -> list[Sample]:
        """The next `groups` whole groups (0: a step's worth, `rl.batch_size` samples) for trainer version
        `version`; `StopRequested` instead once the job is stopping. A step may take its batch in parts
        (`rl.waves`)."""
        stopping.raise_if_requested()
        want = groups or self.rl.batch_size // self.rl.attempts
        if self.rl.mode != "conventional":
            return [s for g in self._collect(version, timeout_s, want) for s in g]
        if not self._round:  # the whole round first: the engines generate it all, then idle
            whole = self._collect(version, timeout_s, self.rl.sync_every * self.rl.batch_size // self.rl.attempts)
            self._round = shuffled_round(whole, self.rng)
        taken, self._round = self._round[:want], self._round[want:]
        return [s for g in taken for s in g]

    def _drop_stale(self, groups: list[Group], version: int) -> list[Group]:
        fresh, stale = split_stale(groups, version, self.rl.max_lag)
        self.counts.dropped_groups += len(stale)
        self.counts.dropped_samples += sum(len(g) for g in stale)
        return fresh

    def _collect(self, version: int, timeout_s: float, want: int) -> list[Group]:
        t0 = time.perf_counter()
        self.buffer = self._drop_stale(self.buffer, version)  # leftovers may have aged past max_lag
        while len(self.buffer) < want:
            got = self._get(timeout=1.0, what="training finished")
            if got is None:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(
                        f"no rollouts for {timeout_s:.0f} s (world.timeout_s): are the inference ranks alive?"
                    )
                continue
            self._take(got, version)
        taken, self.buffer = self.buffer[:want], self.buffer[want:]
        return taken

    def _take(self, got: tuple[int, Group | EvalReport, EngineStats], version: int) -> None:
        """File one received item: an evaluation report aside, a group into the buffer (unless filtered/stale)."""
        src, payload, stats = got
        self.engine_stats[src] = stats
        # the longest update pause each engine reported since the trainer last read them (`take_pause_max`)
        self.pause_max[src] = max(self.pause_max.get(src, 0.0), stats.pause_ms_max)
        if isinstance(payload, EvalReport):
            self.eval_reports.append(payload)
            return
        group = payload
        gid = group[0].group_id
        key = gid % self.n_engines
        self.max_gid[key] = max(self.max_gid.get(key, -1), gid)
        if not all(math.isfinite(lp) for s in group for lp in s.logprobs):
            self.counts.nonfinite_samples += len(group)
            return
        # on the advantages (a loss's overlong punishment can tell apart attempts that scored the same)
        if self.rl.filter_zero_advantage and is_zero_advantage_group([s.advantage for s in group]):
            self.counts.filtered_groups += 1
            self.counts.filtered_samples += len(group)
            return
        self.buffer += self._drop_stale([group], version)

    def _get(self, timeout: float, what: str) -> tuple[int, Group | EvalReport, EngineStats] | None:
        """The source's next item (None: nothing within `timeout`); an error if it failed or every inference rank
        ended before `what`; `StopRequested` once the job is stopping (stopping.py), also in place of such an
        error when the stop explains it (the receiver fails, or ends, as the inference ranks die)."""
        stopping.raise_if_requested()
        try:
            got = self.source.get(timeout=timeout)
            if got is None and self.source.finished():
                raise RuntimeError(f"every inference rank stopped sending before {what}")
            return got
        except RuntimeError:
            if stopping.explains_failure():
                stopping.raise_if_requested()
            raise

    def wait_for(self, done: Callable[[], bool], version: int, timeout_s: float, what: str) -> None:
        """Keep receiving (groups go to the buffer) until `done()` holds; an error naming `what` after
        `timeout_s`; gives up when the job is stopping."""
        t0 = time.perf_counter()
        while not done():
            try:
                got = self._get(timeout=0.5, what=what)
            except StopRequested:
                return  # the engines are stopping too: what they have not reported will not come
            if got is not None:
                self._take(got, version)
            elif time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"waited {timeout_s:.0f} s (world.timeout_s) for {what}")
