"""Completion-length distributions for the simulator: each draws `n` lengths (tokens, >= 1) from a numpy
`Generator`, so a seed fixes every draw.

- `Empirical`: the lengths of a list (e.g. a rollout dump's completions: `Empirical.from_rollouts`), drawn with
  replacement;
- `PowerLaw`: P(L) ~ L^-alpha on the integers [lo, hi] (a long tail: most completions short, a few near the cap);
- `Uniform`: the integers [lo, hi] equally likely (lo = hi: a fixed length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class Lengths(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64, each >= 1)."""
        ...

    def mean(self) -> float:
        """The distribution's mean length."""
        ...


def _bounds(name: str, lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}: need 1 <= lo <= hi, got lo = {lo}, hi = {hi}")


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _bounds("Uniform", self.lo, self.hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)

    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class PowerLaw:
    """P(L) proportional to L^-alpha for the integers lo..hi (alpha = 0: uniform)."""

    alpha: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _bounds("PowerLaw", self.lo, self.hi)
        if not np.isfinite(self.alpha):
            raise ValueError(f"PowerLaw: alpha = {self.alpha} must be finite")

    def probabilities(self) -> np.ndarray:
        w = np.arange(self.lo, self.hi + 1, dtype=float) ** -self.alpha
        return w / w.sum()

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        cdf = np.cumsum(self.probabilities())
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
        return self.lo + np.minimum(idx, self.hi - self.lo).astype(np.int64)

    def mean(self) -> float:
        return float(np.arange(self.lo, self.hi + 1) @ self.probabilities())


@dataclass(frozen=True)
class Empirical:
    """The lengths of `values`, each equally likely (drawn with replacement)."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.values or min(self.values) < 1:
            raise ValueError("Empirical: need at least one length, each >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size=n)]

    def mean(self) -> float:
        return float(np.mean(self.values))

    @classmethod
    def from_rollouts(cls, paths: list[str | Path] | str | Path) -> Empirical:
        """The completion lengths (`tokens`) of rollout dumps (`<output_dir>/rl/rollouts/step-*.jsonl`, one JSON
        record a line: training/rollout_log.py); a folder reads every step-*.jsonl in it."""
        files: list[Path] = []
        for p in [paths] if isinstance(paths, (str, Path)) else paths:
            p = Path(p)
            files += sorted(p.glob("step-*.jsonl")) if p.is_dir() else [p]
        lengths = []
        for f in files:
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        lengths.append(int(json.loads(line)["tokens"]))
                    except (KeyError, ValueError, TypeError) as e:
                        raise ValueError(f"{f}:{i}: not a rollout record with 'tokens' ({e})") from None
        if not lengths:
            raise ValueError(f"no rollout records in {[str(f) for f in files] or paths}")
        return cls(tuple(max(n, 1) for n in lengths))
