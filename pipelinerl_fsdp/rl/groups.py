"""Group assembly: a prompt's scored attempts -> the group's `Sample`s, with their group advantages. One function for
the inference loop (which sends the group to the trainer) and the colocated mode (which trains on it at once)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipelinerl_fsdp.config import LossConfig, RLConfig
from pipelinerl_fsdp.rewards.outcomes import OUTCOME_CODE
from pipelinerl_fsdp.rl.advantages import shaped_group_advantages
from pipelinerl_fsdp.samples import Sample


class Attempt(Protocol):
    """A finished completion as an engine returns it (`inference.engine.Request` is one)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


def group_samples(
    group_id: int,
    prompt_ids: list[int],
    attempts: Sequence[Attempt],
    scores: Sequence[tuple[float, str]],
    rl: RLConfig,
    loss: LossConfig,
    max_new_tokens: int,
    logprob_shift: float = 0.0,
) -> list[Sample]:
    """The group's samples, in the order of `attempts`: each attempt with its (reward, outcome) of `scores` and its
    advantage against the group (`rl.baseline`, `rl.std_normalize`, the loss's overlong shaping). `logprob_shift`
    (a test's fault, `job.faults.logprob_shift`) is added to every behaviour log-prob."""
    rewards = [reward for reward, _ in scores]
    advs = shaped_group_advantages(
        rewards,
        [len(a.tokens) for a in attempts],
        rl.baseline,
        rl.std_normalize,
        max_new_tokens,
        loss.overlong_buffer,
        loss.overlong_penalty,
    )
    return [
        Sample(
            group_id,
            prompt_ids,
            a.tokens,
            [lp + logprob_shift for lp in a.logprobs] if logprob_shift else a.logprobs,
            a.versions,
            reward,
            adv,
            a.finished,
            OUTCOME_CODE[outcome],
        )
        for a, (reward, outcome), adv in zip(attempts, scores, advs)
    ]
