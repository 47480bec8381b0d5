"""The exact token-lag distribution of a run, from its rollout dumps (`metrics.rollouts_every = 1`).

Each dump `OUTPUT_DIR/rl/rollouts/step-NNNNNNN.jsonl` holds the step's trained samples, one JSON record each, with
`versions`: [[first token, last token, version], ...] (runs of completion tokens sampled by one policy version;
environment tokens of multi-turn tasks have version `ENV_VERSION` and no lag) and `lag_max`: the trained version
minus the oldest of those versions. A token's lag is the trained version minus its own version. The trained version is
taken from the record itself (`lag_max` + its oldest version), not from the step number: a step whose gradient was
not finite leaves the version where it was (`training/rl_trainer.py`), so step s trains version s - 1 only until then.
The step's metrics (`lag_mean`, `lag_max`, `lag_frac/*`) summarise the same tokens per step; this is the whole run's
histogram, exact (counts per integer lag), with its percentiles.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipelinerl_fsdp.samples import ENV_VERSION


def record_lags(record: dict) -> Counter[int]:
    """Tokens per lag of one dumped sample (environment tokens left out)."""
    ranges = [(a, b, v) for a, b, v in record["versions"] if v != ENV_VERSION]
    if not ranges:
        return Counter()
    trained = record["lag_max"] + min(v for _, _, v in ranges)
    out: Counter[int] = Counter()
    for first, last, v in ranges:
        out[trained - v] += last - first + 1
    return out


def histogram(records: Iterable[dict]) -> dict[int, int]:
    """Tokens per integer lag over `records`, sorted by lag."""
    total: Counter[int] = Counter()
    for r in records:
        total.update(record_lags(r))
    return dict(sorted(total.items()))


def read_dumps(output_dir: Path) -> Iterator[dict]:
    """Every record of a run's rollout dumps, step by step (none when the run wrote none), one at a time: a long run's
    dumps hold every completion's text (hundreds of MB), so they are read line by line, never all at once."""
    for path in sorted((output_dir / "rl" / "rollouts").glob("step-*.jsonl")):
        with path.open() as f:
            yield from (json.loads(line) for line in f if line.strip())


def merge(hists: Iterable[dict]) -> dict[int, int]:
    """The sum of histograms (e.g. of a mode's seeds); keys may be ints or, read back from JSON, strings."""
    total: Counter[int] = Counter()
    for h in hists:
        total.update({int(k): n for k, n in h.items()})
    return dict(sorted(total.items()))


def percentile(hist: dict, q: float) -> int | None:
    """The smallest lag at or below which at least a fraction `q` of the tokens lie (nearest rank); None when the
    histogram is empty."""
    h = sorted((int(k), n) for k, n in hist.items())
    total = sum(n for _, n in h)
    if total == 0:
        return None
    seen = 0
    for lag, n in h:
        seen += n
        if seen >= q * total:
            return lag
    return h[-1][0]


def lag_summary(hist: dict) -> dict:
    """p50, p90 and max of a histogram, beside the histogram itself (JSON-ready: string keys)."""
    lags = [int(k) for k, n in hist.items() if n > 0]
    return {
        "p50": percentile(hist, 0.5),
        "p90": percentile(hist, 0.9),
        "max": max(lags) if lags else None,
        "tokens": sum(hist.values()),
        "hist": {str(int(k)): n for k, n in sorted(hist.items(), key=lambda kv: int(kv[0]))},
    }
