"""The data the two roles exchange: a scored attempt (`Sample`) and an engine's share of an evaluation
(`EvalReport`). The inference loop makes them, the rollout queues carry them (transport/rollouts.py), the trainer
and the pure RL code (rl/) consume them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One attempt at one prompt, with everything the trainer needs."""

    group_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each completion token (under the sampling distribution)
    versions: list[int]  # policy version that produced each completion token
    reward: float
    advantage: float = 0.0
    finished: bool = True  # ended on a stop token (False: cut at max_tokens)
    outcome: int = 0  # rewards.outcomes.OUTCOMES index: what the reward function concluded
    # weight of each of its tokens in the step's loss (rl/normalization.py), set by the first trainer rank
    loss_weight: float = 0.0


@dataclass
class EvalReport:
    """One engine's share of one evaluation set at one policy version: correct samples per problem."""

    set_index: int
    version: int
    samples: int  # completions per problem
    problems: list[int]  # indices into the set
    correct: list[int]  # correct completions of each problem
