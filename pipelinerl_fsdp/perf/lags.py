"""Token lags from version histories, without a per-token loop: the simulator knows, per engine, the step at which
each weight version began, and per sample the engine, the step of its first token and its length; a token's lag is
the trained version minus the version of the engine step that sampled it.

`LagTally` sums, over the samples of many training steps, the tokens at each lag (`hist`) and the lag summed and
counted per tenth of the completion (the project's `rl.positions.tenth`: token j of n is in tenth floor(10 j / n) +
1), from runs of equal version (segments) with numpy.
"""

from __future__ import annotations

import numpy as np

TENTHS = 10
_KEY = 1 << 40  # engine e's step s is key e * _KEY + s: one sorted array for every engine's history


class VersionHistory:
    """Per engine, the steps at which its versions began: `begin(e, step, version)` in increasing step order."""

    def __init__(self, engines: int, version: int = 0) -> None:
        self.steps: list[list[int]] = [[0] for _ in range(engines)]
        self.versions: list[list[int]] = [[version] for _ in range(engines)]
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def begin(self, engine: int, step: int, version: int) -> None:
        """From engine step `step` on (tokens of that step included), `engine` samples with `version`."""
        s, v = self.steps[engine], self.versions[engine]
        if step == s[-1]:
            v[-1] = version  # two changes at one boundary: the later one holds
        else:
            s.append(step)
            v.append(version)
        self._cache = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, versions), sorted by key."""
        if self._cache is None:
            keys = np.concatenate([e * _KEY + np.asarray(s, dtype=np.int64) for e, s in enumerate(self.steps)])
            vers = np.concatenate([np.asarray(v, dtype=np.int64) for v in self.versions])
            self._cache = keys, vers
        return self._cache


def segments(
    history: VersionHistory, engine: np.ndarray, first_step: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of equal version of the samples (engine, step of the first token, tokens): (sample index, first
    position, end position (exclusive), version) per run, positions counted in the completion from 0."""
    keys, vers = history.arrays()
    start = engine * _KEY + first_step
    i0 = np.searchsorted(keys, start, side="right") - 1
    i1 = np.searchsorted(keys, start + length - 1, side="right") - 1
    m = i1 - i0 + 1
    sample = np.repeat(np.arange(len(engine)), m)
    offset = np.arange(len(sample)) - np.repeat(np.cumsum(m) - m, m)
    idx = i0[sample] + offset
    begin = np.where(offset == 0, 0, keys[idx] - start[sample])
    nxt = np.minimum(idx + 1, len(keys) - 1)
    last = offset == m[sample] - 1
    end = np.where(last, length[sample], keys[nxt] - start[sample])
    return sample, begin, end, vers[idx]


class LagTally:
    """Trained tokens by lag and by tenth of their completion, summed over training steps."""

    def __init__(self) -> None:
        self.hist = np.zeros(1, dtype=np.int64)  # tokens at lag 0, 1, ...
        self.tenth_lag = np.zeros(TENTHS)  # summed lag per tenth
        self.tenth_tokens = np.zeros(TENTHS, dtype=np.int64)

    def add(
        self,
        history: VersionHistory,
        trained_version: int,
        engine: np.ndarray,
        first_step: np.ndarray,
        length: np.ndarray,
    ) -> None:
        """The samples (arrays: engine, step of the first token, completion tokens) of a step trained at
        `trained_version`."""
        if len(engine) == 0:
            return
        sample, begin, end, ver = segments(history, engine, first_step, length)
        lag = trained_version - ver
        if lag.min() < 0:
            raise ValueError("a token sampled by a version newer than the one trained")
        counts = np.bincount(lag, weights=end - begin).astype(np.int64)
        if len(counts) > len(self.hist):
            self.hist = np.pad(self.hist, (0, len(counts) - len(self.hist)))
        self.hist[: len(counts)] += counts
        n = length[sample]
        bounds = -(-np.arange(TENTHS + 1)[None, :] * n[:, None] // TENTHS)  # tenth i: [ceil((i-1)n/10), ceil(in/10))
        inside = np.clip(np.minimum(end[:, None], bounds[:, 1:]) - np.maximum(begin[:, None], bounds[:, :-1]), 0, None)
        self.tenth_tokens += inside.sum(axis=0)
        self.tenth_lag += (inside * lag[:, None]).sum(axis=0)

    def percentile(self, p: int) -> float:
        """Nearest rank (as the trainer's `rl.step_metrics.nearest_rank`): the smallest lag that at least p% of
        the tokens do not exceed; NaN with no token."""
        total = int(self.hist.sum())
        if total == 0:
            return float("nan")
        rank = -(-p * total // 100)
        return float(np.searchsorted(np.cumsum(self.hist), rank))

    def mean(self) -> float:
        total = self.hist.sum()
        return float(np.arange(len(self.hist)) @ self.hist / total) if total else float("nan")

    def max(self) -> int:
        nz = np.nonzero(self.hist)[0]
        return int(nz[-1]) if len(nz) else 0

    def by_tenth(self) -> np.ndarray:
        """Mean lag per tenth of the completion (NaN where no token)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tenth_tokens > 0, self.tenth_lag / np.maximum(self.tenth_tokens, 1), np.nan)
