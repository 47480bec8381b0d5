"""Multi-turn episodes on any engine: an `Engine` around another that runs each request carrying an episode
(`Request.episode`, a task's `start_episode`) turn by turn, and returns it once the episode has ended as one
request whose tokens are the whole rollout after the prompt (model and environment turns).

Each model turn is a request of the inner engine whose prompt is the whole history as token ids (the prompt, the
earlier turns' sampled ids as sampled, the environment's ids as tokenized once): nothing is re-tokenized, and the
engine continues the sequence under whatever weights it holds then. A turn's request asks the engine to keep its
KV cache (`Request.keep_cache`) and the next turn's names it (`Request.continues`): the reference engine then
prefills only the new tokens over the kept cache, which an update between the turns leaves in place or
recomputes by `inference.kv_max_age`, as within a turn. vLLM runs without prefix caching, so it prefills the
whole history at each turn under the weights of that moment (docs/vllm.md). In-flight updates land between turns
(the next turn starts under the new version) and within them (as today).

The environment's reply is polled between engine steps and never waited for (a tool runs in its own process,
tools/sandbox.py), so a slow tool stalls only its own episode. Limits: `max_turns` model turns, `turn_tokens` per
model turn, and the request's `max_tokens` for the whole rollout after the prompt (model and environment tokens:
the episode's token budget, checked against the trainer's micro-batch at start-up like any completion's). An
episode is finished (`Request.finished`) when the environment ended it after a turn that ended on its stop token;
one cut by a limit while the environment would still answer (`Episode.would_reply`) is truncated, like a
completion cut at its budget (overlong filtering, `truncated_frac`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.episodes import Episode, env_turn_ids
from pipelinerl_fsdp.inference.engine import Engine, EngineSettings, Request
from pipelinerl_fsdp.samples import ENV_VERSION
from pipelinerl_fsdp.tokenizer import completion_text
from pipelinerl_fsdp.transport.weights import WeightReceiver

# the inner engine's request ids for turns start here, far above rollout and evaluation ids
TURN_RID_BASE = 1 << 60


def scored_text(tokenizer: PreTrainedTokenizerBase, request: Request, stop_ids: list[int]) -> str:
    """The text a finished request's reward scores: an episode's whole transcript, else the completion."""
    if request.transcript is not None:
        return request.transcript
    return completion_text(tokenizer, request.tokens, stop_ids)


@dataclass
class _Episode:
    request: Request  # the caller's request: its tokens, log-probs and versions grow turn by turn
    episode: Episode
    segments: list[str] = field(default_factory=list)  # texts of the model and environment turns, in order
    turns: int = 0
    last_turn: int | None = None  # the inner request id of the latest model turn (its engine may keep its cache)


class TurnEngine(Engine):
    """Runs episodes turn by turn on `inner`; requests without an episode pass through unchanged."""

    def __init__(
        self,
        inner: Engine,
        tokenizer: PreTrainedTokenizerBase,
        fmt: TokenizerConfig,
        stop_ids: list[int],
        max_turns: int,
        turn_tokens: int,
    ) -> None:
        self.inner, self.tokenizer, self.fmt, self.stop_ids = inner, tokenizer, fmt, stop_ids
        self.max_turns, self.turn_tokens = max_turns, turn_tokens
        self._turn_of: dict[int, _Episode] = {}  # inner request id -> its episode, while the turn generates
        self._replying: list[_Episode] = []  # episodes waiting for the environment's reply
        self._next_rid = TURN_RID_BASE
        # cumulative: tool calls by outcome, environment turns, episodes ended
        self.tool_outcomes: Counter[str] = Counter()

    @classmethod
    def create(cls, settings: EngineSettings) -> tuple[Engine, WeightReceiver]:
        raise NotImplementedError("TurnEngine wraps an engine that the factory built")

    @property  # type: ignore[override]
    def version(self) -> int:
        return self.inner.version

    def add(self, request: Request) -> None:
        if request.episode is None:
            self.inner.add(request)
            return
        self._start_turn(_Episode(request, request.episode), request.prompt_ids)

    def _start_turn(self, ep: _Episode, history: list[int]) -> None:
        left = ep.request.max_tokens - len(ep.request.tokens)
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        r = ep.request
        self._turn_of[rid] = ep
        turn = Request(rid, history, min(self.turn_tokens, left), temperature=r.temperature, top_p=r.top_p)
        turn.keep_cache, turn.continues, ep.last_turn = True, ep.last_turn, rid
        self.inner.add(turn)

    def step(self) -> list[Request]:
        done: list[Request] = []
        for r in self.inner.step() if self.inner.num_unfinished() else []:
            ep = self._turn_of.pop(r.request_id, None)
            if ep is None:
                done.append(r)
                continue
            req = ep.request
            req.tokens += r.tokens
            req.logprobs += r.logprobs
            req.versions += r.versions
            req.finished = r.finished
            ep.turns += 1
            text = completion_text(self.tokenizer, r.tokens, self.stop_ids)
            ep.segments.append(text)
            if ep.turns >= self.max_turns or len(req.tokens) >= req.max_tokens:
                # cut with a turn the environment would answer: the episode did not finish, it was truncated
                req.finished = r.finished and not ep.episode.would_reply(text, r.finished)
                done.append(self._end(ep))
            else:
                ep.episode.submit(text, r.finished)
                self._replying.append(ep)
        still = []
        for ep in self._replying:
            reply = ep.episode.poll()
            if reply is None:
                still.append(ep)
                continue
            if reply.tool_outcome is not None:
                self.tool_outcomes[reply.tool_outcome] += 1
            if reply.text is None:
                done.append(self._end(ep))
                continue
            req = ep.request
            ids = env_turn_ids(self.tokenizer, reply.text, self.fmt)
            if len(req.tokens) + len(ids) >= req.max_tokens:  # no room left for a model turn after it
                req.finished = False
                done.append(self._end(ep))
                continue
            req.tokens += ids
            req.logprobs += [0.0] * len(ids)
            req.versions += [ENV_VERSION] * len(ids)
            ep.segments.append(reply.text)
            self._start_turn(ep, req.prompt_ids + req.tokens)
        self._replying = still
        if not done and still and not self.inner.num_unfinished():
            time.sleep(0.001)  # only replies outstanding (a tool running): the loop polls again without spinning
        return done

    def _end(self, ep: _Episode) -> Request:
        ep.episode.close()
        if ep.last_turn is not None:
            self.inner.forget(ep.last_turn)
        req = ep.request
        req.transcript, req.turns = "".join(ep.segments), ep.turns
        return req

    def num_unfinished(self) -> int:
        """Requests of the inner engine and episodes waiting for a reply (they hold no engine slot, but are in
        flight: an async update waits for them, and the loop keeps stepping while they wait)."""
        return self.inner.num_unfinished() + len(self._replying)

    def stats(self) -> tuple[int, float, float]:
        return self.inner.stats()

    def load_update(self, receiver: WeightReceiver, version: int, kv_max_age: int) -> int:
        return self.inner.load_update(receiver, version, kv_max_age)

    def stage_update(self, receiver: WeightReceiver) -> None:
        self.inner.stage_update(receiver)

    def forget(self, request_id: int) -> None:
        self.inner.forget(request_id)

    def apply_staged(self, version: int) -> None:
        self.inner.apply_staged(version)

    def close(self) -> None:
        for ep in [*self._replying, *self._turn_of.values()]:
            ep.episode.close()
            if ep.last_turn is not None:
                self.inner.forget(ep.last_turn)
        self._replying, self._turn_of = [], {}
        self.inner.close()
