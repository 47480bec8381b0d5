"""The collector's rules: whole groups, stale groups dropped whole and counted, zero-advantage filter, leftovers
re-checked at the next step, conventional rounds collected at the round's first step."""

from __future__ import annotations

import copy
import json
import random
import threading

import pytest

from pipelinerl_fsdp.config import RLConfig
from pipelinerl_fsdp.rl.advantages import group_advantages
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.training.collector import Collector, CollectorCounts, group_lag, shuffled_round, split_stale


def group(
    gid: int, versions: list[list[int]], rewards: list[float] | None = None, advantages: list[float] | None = None
) -> list[Sample]:
    """A finished group as an engine sends it: advantages against the group mean unless given."""
    rewards = rewards or [float(i % 2) for i in range(len(versions))]
    advantages = advantages or group_advantages(rewards)
    return [
        Sample(gid, [1, 2], [3] * len(v), [-0.1] * len(v), v, r, a) for v, r, a in zip(versions, rewards, advantages)
    ]


class FakeSource:
    """Hands out queued groups; `finished()` once empty and closed."""

    def __init__(self, groups: list[list[Sample]]) -> None:
        self.groups = list(groups)
        self.closed = threading.Event()

    def get(self, timeout: float):
        if self.groups:
            g = self.groups.pop(0)
            return 1, g, EngineStats(gen_tokens=1.0, busy_s=1.0, elapsed_s=1.0)
        return None

    def qsize(self) -> int:
        return len(self.groups)

    def finished(self) -> bool:
        return not self.groups and self.closed.is_set()


def rl(**kw) -> RLConfig:
    return RLConfig(**{"attempts": 2, "batch_size": 4, "max_lag": 2, **kw})


def test_group_lag_is_that_of_the_oldest_token():
    g = group(0, [[5, 6], [3, 7]])
    assert group_lag(g, 7) == 4
    fresh, stale = split_stale([g, group(1, [[6], [7]])], 7, max_lag=2)
    assert [x[0].group_id for x in fresh] == [1] and [x[0].group_id for x in stale] == [0]


def test_a_group_with_one_stale_sample_is_dropped_whole_and_counted():
    # group 1 has one sample whose first token is 3 versions old at version 5 (max_lag 2): the whole group goes
    src = FakeSource([group(0, [[5], [5]]), group(1, [[2, 5], [5, 5]]), group(2, [[4], [5]])])
    c = Collector(src, rl(), n_engines=1)
    batch = c.next_batch(version=5, timeout_s=5)
    assert sorted({s.group_id for s in batch}) == [0, 2] and len(batch) == 4
    assert c.counts.dropped_groups == 1 and c.counts.dropped_samples == 2


def test_leftovers_are_checked_again_at_the_next_step():
    src = FakeSource(
        [group(0, [[3], [3]]), group(1, [[3], [3]]), group(2, [[3], [3]]), group(3, [[6], [6]]), group(4, [[6], [6]])]
    )
    c = Collector(src, rl(), n_engines=1)
    first = c.next_batch(version=3, timeout_s=5)
    assert {s.group_id for s in first} == {0, 1} and len(c.buffer) == 0  # the batch took two whole groups
    # group 2 waits in the buffer only if received; take one more step at version 6: group 2 (version 3) is stale
    second = c.next_batch(version=6, timeout_s=5)
    assert {s.group_id for s in second} == {3, 4}
    assert c.counts.dropped_groups == 1 and c.counts.dropped_samples == 2


def test_buffered_leftover_group_ages_out():
    src = FakeSource([group(0, [[3], [3]]), group(1, [[3], [3]]), group(2, [[3], [3]])])
    c = Collector(src, rl(batch_size=2), n_engines=1)
    c.next_batch(version=3, timeout_s=5)  # takes group 0
    c.buffer.append(src.groups.pop(0))  # group 1 waits as a leftover (as if received during the last step)
    src.groups.append(group(9, [[7], [7]]))
    batch = c.next_batch(version=7, timeout_s=5)  # group 1 is now 4 versions old: dropped before group 2 or 9
    assert {s.group_id for s in batch} == {9}
    assert c.counts.dropped_groups == 2  # group 1 (leftover) and group 2 (on arrival)


def test_zero_advantage_groups_are_filtered_and_counted():
    src = FakeSource(
        [
            group(0, [[1], [1]], [1.0, 1.0]),
            group(1, [[1], [1]], [0.0, 1.0]),
            group(2, [[1], [1]], [0.0, 0.0]),
            group(3, [[1], [1]], [1.0, 0.0]),
            # the same rewards, told apart by a loss's overlong punishment: a learning signal, kept
            group(4, [[1], [1]], [1.0, 1.0], [0.25, -0.25]),
            group(5, [[1], [1]], [0.0, 1.0]),
        ]
    )
    c = Collector(src, rl(filter_zero_advantage=True), n_engines=1)
    batch = c.next_batch(version=1, timeout_s=5) + c.next_batch(version=1, timeout_s=5)
    assert {s.group_id for s in batch} == {1, 3, 4, 5}
    assert c.counts.filtered_groups == 2 and c.counts.filtered_samples == 4 and c.counts.dropped_groups == 0


def test_conventional_round_is_collected_at_its_first_step_and_handed_out_shuffled():
    groups = [group(i, [[0], [0]]) for i in range(6)]
    src = FakeSource(groups)
    c = Collector(src, rl(mode="conventional", sync_every=3, max_lag=8), n_engines=1, rng=random.Random(5))
    first = c.next_batch(version=0, timeout_s=5)
    assert not src.groups  # all three batches of the round were taken at once
    batches = [first, c.next_batch(version=1, timeout_s=5), c.next_batch(version=2, timeout_s=5)]
    ids = [[s.group_id for s in b[::2]] for b in batches]
    assert all(len(b) == 4 for b in batches) and all(b[0].group_id == b[1].group_id for b in batches)
    # the order the same seed draws (an independent shuffle of the arrival order), not the arrival order
    expect = list(range(6))
    random.Random(5).shuffle(expect)
    assert ids == [expect[0:2], expect[2:4], expect[4:6]] and expect != list(range(6))


def test_shuffled_round_is_a_permutation_with_the_same_multiset():
    groups = [group(i % 7, [[0], [0]]) for i in range(40)]  # repeated ids: a multiset
    rng = random.Random(0)
    out = shuffled_round(groups, rng)
    assert sorted(id(g) for g in out) == sorted(id(g) for g in groups)
    assert [g[0].group_id for g in out] != [g[0].group_id for g in groups]
    assert [g[0].group_id for g in shuffled_round(groups, random.Random(0))] == [g[0].group_id for g in out]
    # the arrival order (shortest first) no longer decides which step gets which group: over many draws, the first
    # group lands in the round's last quarter about a quarter of the time
    first = id(groups[0])
    last_quarter = sum([id(g) for g in shuffled_round(groups, random.Random(k))].index(first) >= 30 for k in range(400))
    assert 60 <= last_quarter <= 140


def test_a_step_taken_in_parts_gets_whole_groups_as_soon_as_they_arrive():
    # rl.waves: the trainer asks for one group at a time; the collector waits for no more than that
    src = FakeSource([group(i, [[2], [2]]) for i in range(3)])
    c = Collector(src, rl(batch_size=4, waves=2), n_engines=1)
    part = c.next_batch(version=2, timeout_s=5, groups=1)
    assert [s.group_id for s in part] == [0, 0] and len(src.groups) == 2  # group 1 not received yet
    assert [s.group_id for s in c.next_batch(version=2, timeout_s=5, groups=1)] == [1, 1]


def test_conventional_round_taken_in_parts_is_collected_once_and_each_group_handed_out_once():
    src = FakeSource([group(i, [[0], [0]]) for i in range(4)])
    c = Collector(src, rl(mode="conventional", sync_every=2, max_lag=8), n_engines=1)
    parts = [c.next_batch(version=0, timeout_s=5, groups=1)]
    assert not src.groups  # the round's 4 groups were taken at its first part
    parts += [c.next_batch(version=0, timeout_s=5, groups=1) for _ in range(3)]
    assert sorted(p[0].group_id for p in parts) == [0, 1, 2, 3] and all(len(p) == 2 for p in parts)


def test_stream_positions_per_engine_for_resume():
    src = FakeSource([group(0, [[0], [0]]), group(3, [[0], [0]]), group(1, [[0], [0]]), group(2, [[0], [0]])])
    c = Collector(src, rl(), n_engines=2)
    c.next_batch(0, 5)
    c.next_batch(0, 5)
    assert c.stream_next() == {"0": 4, "1": 5}  # newest group ids 2 (engine 0) and 3 (engine 1), stride 2


def test_no_rollouts_is_a_named_error(monkeypatch):
    from pipelinerl_fsdp.runtime import stopping

    monkeypatch.setattr(stopping, "explains_failure", lambda wait_s=5.0: False)  # no stop signal comes
    src = FakeSource([])
    src.closed.set()
    with pytest.raises(RuntimeError, match="every inference rank stopped sending before training finished"):
        Collector(src, rl(), n_engines=1).next_batch(0, 5)


def test_a_group_with_a_non_finite_logprob_is_dropped_and_counted():
    bad = group(1, [[1], [1]])
    bad[1].logprobs[0] = float("nan")
    src = FakeSource([group(0, [[1], [1]]), bad, group(2, [[1], [1]])])
    c = Collector(src, rl(), n_engines=1)
    assert {s.group_id for s in c.next_batch(1, 5)} == {0, 2}
    assert c.counts.nonfinite_samples == 2


def test_a_restored_collector_continues_like_the_uninterrupted_one():
    nonfinite = group(4, [[4], [4]])
    nonfinite[1].logprobs = [float("nan")]
    # before the checkpoint: fresh, stale (max_lag 2), zero-advantage, non-finite, fresh; from two engines
    groups = [group(0, [[4], [4]]), group(1, [[1], [4]]), group(3, [[4], [4]], [1.0, 1.0]), nonfinite]
    groups += [group(2, [[4], [4]])]
    # after it: fresh, stale, zero-advantage, fresh, fresh, fresh
    groups += [group(5, [[5], [5]]), group(6, [[4], [1]]), group(7, [[5], [5]], [0.0, 0.0]), group(8, [[5], [5]])]
    groups += [group(9, [[5], [5]]), group(10, [[5], [5]])]
    settings = rl(filter_zero_advantage=True)
    whole = Collector(FakeSource(groups), settings, n_engines=2)
    assert [s.group_id for s in whole.next_batch(version=4, timeout_s=5)] == [0, 0, 2, 2]
    assert not whole.buffer  # between two steps, where the trainer checkpoints
    state = json.loads(json.dumps(whole.state_dict()))  # as the checkpoint's meta.json holds it
    restored = Collector(FakeSource(copy.deepcopy(whole.source.groups)), settings, n_engines=2)
    restored.load_state_dict(state)
    assert restored.state_dict() == whole.state_dict()
    for version in (5, 6):
        ids = [s.group_id for s in whole.next_batch(version, timeout_s=5)]
        assert [s.group_id for s in restored.next_batch(version, timeout_s=5)] == ids
        assert restored.state_dict() == whole.state_dict()
    assert ids == [9, 9, 10, 10]
    assert restored.counts == whole.counts == CollectorCounts(4, 2, 4, 2, 2)
    assert restored.stream_next() == {"0": 12, "1": 11}


def test_an_older_checkpoint_without_the_newer_counts_restores_them_as_zero():
    c = Collector(FakeSource([]), rl(), n_engines=1)
    c.load_state_dict({"dropped_stale": 6, "stream_next": {"0": 9}})
    assert c.counts.dropped_samples == 6 and c.counts.filtered_samples == 0
    assert c.stream_next() == {"0": 9}
