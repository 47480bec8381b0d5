"""Multi-turn episodes: what an environment (a task with `Task.start_episode`) answers to each model turn, and how
a rollout of turns stays one token sequence whose ids are never re-derived from text.

A rollout of turns is the prompt, then model turn, environment turn, model turn, ... : the model's tokens are kept
as sampled (with their behaviour log-probs and per-token versions, the turn's stop token included), the
environment's text is tokenized once (`env_turn_ids`, with the chat template's turn boundary as ids) and appended
with version `samples.ENV_VERSION`, and the loss, the advantages' normalisation, the ESS and every lag leave those
tokens out. The engine continues the sequence from the whole history (`inference/turns.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.samples import ENV_VERSION


@dataclass
class Reply:
    """The environment's answer to a model turn: `text` to append before the model's next turn, or None when the
    episode ends (its reward then comes from the task's reward on the whole transcript). `tool_outcome`: the
    outcome of the tool call this reply reports (tools/sandbox.py's TOOL_OUTCOMES), if the turn made one."""

    text: str | None
    tool_outcome: str | None = None


class Episode:
    """One episode of an environment. The driver calls `submit` with each model turn, then `poll` until it returns
    the reply (`poll` never blocks: a tool runs off the decode loop). A synchronous environment implements `respond`
    only."""

    def __init__(self) -> None:
        self._reply: Reply | None = None

    def respond(self, turn: str, finished: bool) -> Reply:
        """The reply to the model's turn `turn` (its text before the stop token; `finished`: it ended on a stop
        token rather than at the turn's token budget)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither respond nor submit/poll")

    def submit(self, turn: str, finished: bool) -> None:
        self._reply = self.respond(turn, finished)

    def poll(self) -> Reply | None:
        """The reply to the last submitted turn once it is ready, else None."""
        reply, self._reply = self._reply, None
        return reply

    def would_reply(self, turn: str, finished: bool) -> bool:
        """Whether the environment would answer `turn` (the episode would go on), asked instead of `submit` of a
        turn that ends the episode at `max_turns` or at the token budget: such an episode is then cut short
        (truncated, not finished). By default `respond`'s answer (False for an environment that implements only
        `submit`/`poll`: it overrides this to tell, without running anything, as a tool-calling one does)."""
        if type(self).respond is Episode.respond:
            return False
        return self.respond(turn, finished).text is not None

    def close(self) -> None:
        """Release what the episode holds (a running tool call): called when the episode ends or is dropped."""


def env_turn_ids(tokenizer: PreTrainedTokenizerBase, text: str, fmt: TokenizerConfig) -> list[int]:
    """Token ids of an environment turn, appended right after a model turn that ended on its stop token.

    Plain prompts (`tokenizer.use_chat_template = false`): the text's ids. With the chat template: the ids the
    template puts between the model's stop token and the next assistant turn's first token: what follows the stop
    token in a finished assistant turn (e.g. a newline), the user turn holding `text`, and the generation prompt,
    taken from the template itself so that the conversation's ids equal the template's (tests/unit/
    test_episodes.py)."""
    if not fmt.use_chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    kw = fmt.chat_template_kwargs
    before = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    base = _ids(tokenizer.apply_chat_template(before, tokenize=True, add_generation_prompt=False, **kw))
    full = _ids(
        tokenizer.apply_chat_template(
            [*before, {"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, **kw
        )
    )
    if full[: len(base)] != base:
        raise ValueError("the chat template renders an earlier turn differently once a user turn follows it")
    stops = {tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)}
    last_stop = max((i for i, t in enumerate(base) if t in stops), default=len(base) - 1)
    return base[last_stop + 1 :] + full[len(base) :]


def _ids(x: object) -> list[int]:
    return list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x)  # type: ignore[index]


def turn_spans(versions: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each model turn in a rollout's completion: the maximal runs of tokens a policy sampled."""
    spans, start = [], None
    for i, v in enumerate(versions):
        if v != ENV_VERSION and start is None:
            start = i
        elif v == ENV_VERSION and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(versions)))
    return spans


def turn_indices(versions: list[int]) -> list[int]:
    """Per completion token, the index (from 1) of the model turn it belongs to; 0 on environment tokens."""
    out = [0] * len(versions)
    for i, (a, b) in enumerate(turn_spans(versions), 1):
        out[a:b] = [i] * (b - a)
    return out
