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

from pipelinerl_fsdp.config import ConfigError, TokenizerConfig
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


class ChatTemplateError(ConfigError):
    """The chat template cannot frame an environment turn (`check_env_template` names it at start-up)."""


def env_turn_ids(tokenizer: PreTrainedTokenizerBase, text: str, fmt: TokenizerConfig) -> list[int]:
    """Token ids of an environment turn, appended right after a model turn that ended on its stop token.

    Plain prompts (`tokenizer.use_chat_template = false`): the text's ids. With the chat template: the ids the
    template puts between the model's stop token and the next assistant turn's first token: what follows the end
    token of a finished assistant turn (e.g. a newline), the user turn holding `text`, and the generation prompt,
    taken from the template itself so that the conversation's ids equal the template's (tests/unit/
    test_episodes.py). A template that renders an earlier assistant turn differently once a user turn follows it
    (Qwen3's drops the thinking block) is fine: the model's turns stay as sampled, and only what follows an
    assistant turn's end token is taken from the template's rendering of the conversation."""
    if not fmt.use_chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    user = [{"role": "user", "content": "a"}]
    before = [*user, {"role": "assistant", "content": "b"}]
    base = _render(tokenizer, before, False, fmt)
    full = _render(tokenizer, [*before, {"role": "user", "content": text}], True, fmt)
    stops = {tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)}
    if full[: len(base)] == base:  # the history renders as it was: the end of `base`, then the rest of `full`
        last_stop = max((i for i, t in enumerate(base) if t in stops), default=len(base) - 1)
        return base[last_stop + 1 :] + full[len(base) :]
    opening = _render(tokenizer, user, False, fmt)
    if base[: len(opening)] != opening or full[: len(opening)] != opening:
        raise ChatTemplateError(
            "tokenizer.use_chat_template: the chat template renders the first user turn differently once other "
            "turns follow it, so an environment turn's ids cannot be taken from it"
        )
    # the assistant turn's end token: the last special token of `base` (after the opening user turn); in `full`,
    # where the history's assistant turn is rendered anew, the environment turn starts after its first one
    ends = [i for i in range(len(opening), len(base)) if base[i] in stops]
    k = next((i for i in range(len(opening), len(full)) if ends and full[i] == base[ends[-1]]), None)
    if k is None:
        raise ChatTemplateError(
            "tokenizer.use_chat_template: the chat template renders an earlier assistant turn differently once a "
            "user turn follows it, and ends an assistant turn with no special token to find where the next turn "
            "starts"
        )
    return full[k + 1 :]


def check_env_template(tokenizer: PreTrainedTokenizerBase, fmt: TokenizerConfig) -> None:
    """At start-up, before any episode: the chat template frames an environment turn (`env_turn_ids`), or a
    `ChatTemplateError` says why not."""
    if not fmt.use_chat_template:
        return
    ids = env_turn_ids(tokenizer, "ok", fmt)
    if not ids:
        raise ChatTemplateError("tokenizer.use_chat_template: the chat template gives an environment turn no ids")


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation: bool, fmt: TokenizerConfig
) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation, **fmt.chat_template_kwargs
        )
    except Exception as e:  # a template error (jinja's, or the template's raise_exception) names the template
        raise ChatTemplateError(
            f"tokenizer.use_chat_template: the chat template cannot render a conversation of turns "
            f"({type(e).__name__}: {e})"
        ) from None
    return _ids(out)


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
