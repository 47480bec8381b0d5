"""The data the two roles exchange: a scored attempt (`Sample`), an engine's share of an evaluation (`EvalReport`)
and an engine's cumulative counters (`EngineStats`). The inference loop makes them, the rollout queues carry them
(transport/rollouts.py), the trainer and the pure RL code (rl/) consume them."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.records import MAX, SUM, stat

# The version of a token the environment wrote into a rollout (a tool's result, feedback, the next user turn) rather
# than a policy sampled: it is context for the model's next turn, left out of the loss, the importance weights, the
# ESS and every lag (its log-prob is not a behaviour log-prob).
ENV_VERSION = -1


def model_versions(versions: list[int]) -> list[int]:
    """The versions of the tokens a policy sampled, in order (environment tokens left out)."""
    return [v for v in versions if v != ENV_VERSION]


@dataclass
class Sample:
    """One attempt at one prompt, with everything the trainer needs. In a multi-turn rollout `completion_ids` holds
    every turn after the prompt, the model's tokens and the environment's (version `ENV_VERSION`) interleaved."""

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

    @property
    def model_tokens(self) -> int:
        """Completion tokens a policy sampled (those the loss counts)."""
        return sum(1 for v in self.versions if v != ENV_VERSION)


@dataclass
class EvalReport:
    """One engine's share of one evaluation set at one policy version: correct samples per problem."""

    set_index: int
    version: int
    samples: int  # completions per problem
    problems: list[int]  # indices into the set
    correct: list[int]  # correct completions of each problem


@dataclass
class EngineStats:
    """An engine's cumulative counters, sent with each of its messages; the trainer turns the step's deltas of their
    sum over the engines into the step's rates and fractions (rl/step_metrics.py). A new counter is a new field
    here: the wire and the reduction over engines follow from the fields (records.py)."""

    gen_tokens: float = stat(SUM)
    busy_s: float = stat(SUM)  # time with a sequence in flight, not paused (inference/busy.py)
    elapsed_s: float = stat(SUM)  # the inference loop's wall time
    seq_s: float = stat(SUM)  # sequences in flight x busy seconds (Engine.stats)
    send_blocked_s: float = stat(SUM)  # the loop's time waiting for room in its send queue (trainer back-pressure)
    kv_recomputed: float = stat(SUM)  # sequences whose KV cache an update recomputed (inference.kv_max_age)
    # multi-turn episodes' tool calls, and those that ended in each failure outcome (tools/sandbox.py)
    tool_calls: float = stat(SUM)
    tool_timeout: float = stat(SUM)
    tool_error: float = stat(SUM)
    tool_output_truncated: float = stat(SUM)
    # weight-update pauses: count and milliseconds, and the longest one since the engine's last send
    updates: float = stat(SUM)
    pause_ms_sum: float = stat(SUM)
    pause_ms_max: float = stat(MAX, default=0.0)
    skipped_prompts: float = stat(SUM)  # prompts over task.max_prompt_tokens, skipped
