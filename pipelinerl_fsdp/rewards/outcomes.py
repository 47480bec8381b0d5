"""What a reward function can conclude about one completion, logged per step as fractions (`outcome/<kind>`)."""

from __future__ import annotations

# Order matters: the index is the code that travels with a sample to the trainer.
OUTCOMES = ("correct", "wrong", "no_answer", "unparsable", "timeout", "truncated", "error")
OUTCOME_CODE = {name: i for i, name in enumerate(OUTCOMES)}


def outcome_for(reward: float, finished: bool) -> str:
    """The outcome of an exact-match reward: truncated (no stop token within the budget) first, then by reward."""
    if not finished:
        return "truncated"
    return "correct" if reward >= 1.0 else "wrong"
