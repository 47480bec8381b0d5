"""Effective sample size of the importance weights: how on-policy a step's data is (1 = fully on-policy)."""

from __future__ import annotations


def ess_from_sums(sum_w: float, sum_w2: float, n: float) -> float:
    """ESS = (sum w)^2 / (sum w^2) / N over the N output tokens of a step, in (0, 1].

    Computed from sums so that micro-batches and ranks can be reduced first. NaN when there are no tokens.
    """
    if n <= 0 or sum_w2 <= 0:
        return float("nan")
    return (sum_w * sum_w) / sum_w2 / n
