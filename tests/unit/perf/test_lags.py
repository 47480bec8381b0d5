"""Token lags from version histories against a per-token loop (the trainer's own definitions: lag = trained
version - the token's version; tenth = floor(10 j / n) + 1, rl/positions.py; percentiles by nearest rank)."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from pipelinerl_fsdp.perf.lags import LagTally, VersionHistory
from pipelinerl_fsdp.rl.positions import tenth
from pipelinerl_fsdp.rl.step_metrics import nearest_rank


def test_tally_equals_a_per_token_loop():
    rng = np.random.default_rng(3)
    engines = 3
    history = VersionHistory(engines)
    changes = []
    for e in range(engines):
        steps = np.sort(rng.choice(np.arange(1, 400), size=12, replace=False))
        vers = np.arange(1, 13)
        changes.append(([0, *steps.tolist()], [0, *vers.tolist()]))
        for s, v in zip(steps, vers):
            history.begin(e, int(s), int(v))
    tally, lags, tenth_sum, tenth_n = LagTally(), [], np.zeros(10), np.zeros(10)
    for trained in (12, 15):
        eng = rng.integers(0, engines, size=40)
        first = rng.integers(0, 300, size=40)
        length = rng.integers(1, 100, size=40)
        tally.add(history, trained, eng, first, length)
        for e, s0, n in zip(eng, first, length):
            steps, vers = changes[e]
            for j in range(n):
                lag = trained - vers[bisect.bisect_right(steps, s0 + j) - 1]
                lags.append(lag)
                tenth_sum[tenth(j, n) - 1] += lag
                tenth_n[tenth(j, n) - 1] += 1
    assert list(tally.hist) == list(np.bincount(lags))
    assert tally.by_tenth() == pytest.approx(tenth_sum / tenth_n)
    ordered = sorted(lags)
    assert (tally.percentile(50), tally.percentile(90)) == (nearest_rank(ordered, 50), nearest_rank(ordered, 90))
    assert tally.max() == max(lags) and tally.mean() == pytest.approx(np.mean(lags))


def test_a_token_newer_than_the_trained_version_is_an_error():
    history = VersionHistory(1)
    history.begin(0, 5, 3)
    with pytest.raises(ValueError, match="newer"):
        LagTally().add(history, 2, np.array([0]), np.array([4]), np.array([3]))
