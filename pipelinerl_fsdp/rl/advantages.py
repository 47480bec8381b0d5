"""Group-baseline advantages: every prompt is sampled G times and each attempt is scored against its group."""

from __future__ import annotations

from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], baseline: str = "mean", std_normalize: bool = False, eps: float = 1e-6
) -> list[float]:
    """A_i = r_i - baseline of the group.

    baseline "mean": the group mean (PipelineRL's default); "loo": the mean of the *other* attempts
    (leave-one-out, unbiased). std_normalize divides by the group's standard deviation (+eps), as GRPO does.
    """
    g = len(rewards)
    if g == 0:
        raise ValueError("empty group")
    mean = sum(rewards) / g
    if baseline == "mean":
        adv = [r - mean for r in rewards]
    elif baseline == "loo":
        if g < 2:
            raise ValueError("leave-one-out baseline needs at least 2 attempts per prompt (rl.attempts)")
        adv = [r - (mean * g - r) / (g - 1) for r in rewards]
    else:
        raise ValueError(f"unknown advantage baseline {baseline!r}; choose 'mean' or 'loo'")
    if std_normalize:
        std = (sum((r - mean) ** 2 for r in rewards) / g) ** 0.5
        adv = [a / (std + eps) for a in adv]
    return adv


def is_zero_advantage_group(rewards: Sequence[float]) -> bool:
    """All attempts scored the same: the group carries no learning signal (optionally filtered out)."""
    return max(rewards) == min(rewards)
