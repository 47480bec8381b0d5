"""Where a token sits in its completion, relative to the completion's length: its tenth. Long completions span
many optimizer steps in pipeline mode, so their early tokens are older than their late ones; the step's lag,
ESS and |log ratio| by tenth (`lag_pos/<i>`, `ess_pos/<i>`, `abs_log_ratio_pos/<i>`) compare the two ends of
completions of any length."""

from __future__ import annotations

TENTHS = 10


def tenth(j: int, n: int) -> int:
    """The tenth (1..10) of token j (from 0) of a completion of n model tokens: floor(10 j / n) + 1. A completion of
    fewer than 10 tokens leaves some tenths empty (3 tokens: tenths 1, 4, 7)."""
    if not 0 <= j < n:
        raise ValueError(f"token {j} of a completion of {n} tokens")
    return TENTHS * j // n + 1
