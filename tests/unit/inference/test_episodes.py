"""Multi-turn episodes: the guess-number environment, the ids a conversation is made of, and the engine wrapper
that runs episodes turn by turn (versions across a turn boundary with an update between turns)."""

import copy
import random
import time

import pytest
import torch

from kv_reference import full_logprobs, logprobs_old_kv_then_new
from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.episodes import ChatTemplateError, Episode, Reply, check_env_template, env_turn_ids, turn_spans
from pipelinerl_fsdp.inference.engine import Engine, Request
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.inference.turns import TURN_RID_BASE, TurnEngine, scored_text
from pipelinerl_fsdp.job_inputs import build_job_inputs
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.samples import ENV_VERSION
from pipelinerl_fsdp.tasks.guess_number import GuessEpisode, GuessNumber, GuessNumberConfig, bisection_bound
from pipelinerl_fsdp.tasks.tool_arithmetic import ToolArithmetic, ToolArithmeticConfig, ToolEpisode
from pipelinerl_fsdp.tokenizer import build_char_tokenizer, encode_prompt
from pipelinerl_fsdp.training.warmstart import encode_supervised

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_guess_number_rewards_replay_the_transcript():
    task = GuessNumber(GuessNumberConfig(max_turns=6))
    answer = "31;5"
    assert task.reward("20>\n31", answer) == 1.0
    assert task.reward("20>\n25>\n28>\n29>\n30>\n31", answer) == 0.5  # 6 guesses: over the bound of 5
    assert task.reward("20>\n25>\n28>\n29>\n30>\n30>\n31", answer) == 0.0  # over max_turns
    assert task.reward("20>\n30", answer) == 0.0  # never found
    assert task.reward("20>\nx31", answer) == 0.0  # not a guess
    assert task.reward("", answer) == 0.0
    assert bisection_bound(16) == 5 and bisection_bound(15) == 4 and bisection_bound(32) == 6


def test_guess_number_episode_answers_higher_lower_and_ends():
    ep = GuessEpisode(31)
    assert ep.respond("20", True) == Reply(">\n")
    assert ep.respond("40", True) == Reply("<\n")
    assert ep.respond("31", True).text is None  # found
    assert ep.respond("3a", True).text is None  # not a guess: ends (reward 0)
    assert ep.respond("20", False).text is None  # cut at the turn's budget
    ep.submit("20", True)
    assert ep.poll() == Reply(">\n") and ep.poll() is None


def test_reference_transcripts_are_solved_within_max_turns_and_train_only_model_turns():
    task = GuessNumber(GuessNumberConfig())
    tok = build_char_tokenizer(task.alphabet)
    rng = random.Random(0)
    for _ in range(200):
        p = task.sample(rng)
        assert task.reward(p.solution, p.answer) >= 0.5
        turns = task.supervised_turns(p)
        assert "".join(turns) == p.solution
        seq, mask = encode_supervised(tok, p, TokenizerConfig(), task)
        prompt = encode_prompt(tok, p.prompt, TokenizerConfig())
        assert len(mask) == len(seq) - 1
        targets = seq[1:]
        trained = "".join(tok.decode([t]) if t != tok.eos_token_id else "|" for t, m in zip(targets, mask) if m)
        assert trained == "|".join(turns[0::2]) + "|"  # each model turn and its stop token, nothing else
        assert len(seq) - len(prompt) <= task.cfg.max_new_tokens


def test_a_conversation_of_turn_ids_equals_the_chat_templates_ids():
    """Ids built turn by turn (prompt through the template, the model's sampled ids with its stop token, each
    environment turn by env_turn_ids) equal the template's rendering of the whole conversation: nothing the model
    saw differs from what the conversation is."""
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz<>|_0123456789\n ")
    tok.chat_template = CHATML
    fmt = TokenizerConfig(use_chat_template=True)
    ids = encode_prompt(tok, "guess 1 to 9", fmt)
    conversation = [{"role": "user", "content": "guess 1 to 9"}]
    for model_turn, env_turn in [("5", "higher"), ("7", "lower"), ("6", None)]:
        ids += tok(model_turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled
        conversation.append({"role": "assistant", "content": model_turn})
        if env_turn is not None:
            ids += env_turn_ids(tok, env_turn, fmt)
            conversation.append({"role": "user", "content": env_turn})
    expected = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ids == expected[: len(ids)] and expected[len(ids) :] == tok("\n", add_special_tokens=False)["input_ids"]
    plain = TokenizerConfig()
    assert env_turn_ids(tok, ">\n", plain) == tok(">\n", add_special_tokens=False)["input_ids"]


# Qwen3's way with history: the latest assistant turn is rendered as given (an empty thinking block added when it
# has none), an assistant turn that a user turn follows loses its thinking block
THINKING = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
    "{% if loop.index0 < ns.last %}{% set c = c.split('</think>')[-1] %}"
    "{% elif '</think>' not in c %}{% set c = '<think></think>' + c %}{% endif %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _rendered(tok, conversation, generation: bool = False) -> list[int]:
    out = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _template_tokenizer(template: str):
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz<>|_/0123456789\n ")
    tok.chat_template = template
    return tok


def test_a_template_that_rewrites_earlier_assistant_turns_frames_environment_turns():
    """A Qwen3-style template (an earlier assistant turn loses its thinking block once a user turn follows) renders
    the history differently from what the model sampled, which env_turn_ids refused; the model's turns stay as
    sampled, so the environment turn's ids are what the template puts after an assistant turn's end token: the
    conversation built turn by turn is exactly the sampled turns joined by the template's boundaries."""
    tok = _template_tokenizer(THINKING)
    fmt = TokenizerConfig(use_chat_template=True)
    base = _rendered(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    later = _rendered(
        tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    )
    assert later[: len(base)] != base  # the earlier turn renders differently: what the old code refused
    check_env_template(tok, fmt)  # the start-up check passes
    ids = encode_prompt(tok, "guess 1 to 9", fmt)
    text = "<|im_start|>user\nguess 1 to 9<|endoftext|>\n<|im_start|>assistant\n"
    conversation = [{"role": "user", "content": "guess 1 to 9"}]
    for model_turn, env_turn in [("<think>mid</think>5", "higher"), ("<think>up</think>7", "lower"), ("6", None)]:
        ids += tok(model_turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled
        text += model_turn + "<|endoftext|>"
        conversation.append({"role": "assistant", "content": model_turn})
        if env_turn is not None:
            env = env_turn_ids(tok, env_turn, fmt)
            conversation.append({"role": "user", "content": env_turn})
            # the template's own ids for this boundary: the end of its rendering of the conversation so far
            assert _rendered(tok, conversation, generation=True)[-len(env) :] == env
            ids += env
            text += f"\n<|im_start|>user\n{env_turn}<|endoftext|>\n<|im_start|>assistant\n"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "template, why",
    [
        ("{% if messages|length > 2 %}{{ raise_exception('one exchange only') }}{% endif %}" + CHATML, "one exchange"),
        ("{{ messages|length }}" + CHATML, "renders the first user turn differently"),
        (THINKING.replace("<|endoftext|>", "|"), "no special token"),
    ],
)
def test_a_template_that_cannot_frame_an_environment_turn_is_named_at_start_up(tmp_path, template, why):
    tok = _template_tokenizer(template)
    with pytest.raises(ChatTemplateError, match=why):
        check_env_template(tok, TokenizerConfig(use_chat_template=True))
    # the job's inputs check it before any engine starts, for an environment only
    tok.save_pretrained(str(tmp_path))
    args = ["--model.path", str(tmp_path), "--tokenizer.use_chat_template=true", f"--job.output_dir={tmp_path}/o"]
    with pytest.raises(ChatTemplateError, match=why):
        build_job_inputs(load_config(["--config", "guess_number", *args]), tmp_path, None)


class _Counting(Episode):
    """Replies "ab" to every turn until `turns` turns, then ends; records what it was shown."""

    def __init__(self, turns: int) -> None:
        super().__init__()
        self.turns, self.seen = turns, []

    def respond(self, turn: str, finished: bool) -> Reply:
        self.seen.append(turn)
        return Reply(None if len(self.seen) >= self.turns else "ab")


class _Slow(_Counting):
    """A reply that is ready only after two polls (a tool still running)."""

    def submit(self, turn: str, finished: bool) -> None:
        self._pending, self._polls = self.respond(turn, finished), 0

    def poll(self) -> Reply | None:
        self._polls += 1
        return self._pending if self._polls > 2 else None


@pytest.fixture()
def engine_parts():
    tok = build_char_tokenizer("abcdefgh")
    args = flavour_args("debug", vocab_size=len(tok))
    model = build_model(args, seed=0).eval()
    return tok, model


def _turn_engine(tok, model, max_turns=3, turn_tokens=5, temperature=0.7):
    inner = ReferenceEngine(model, 4, 64, [tok.eos_token_id], temperature, seed=0)
    return TurnEngine(inner, tok, TokenizerConfig(), [tok.eos_token_id], max_turns, turn_tokens), inner


def test_turn_engine_continues_the_sequence_with_environment_tokens_masked_and_ids_kept(engine_parts):
    tok, model = engine_parts
    engine, inner = _turn_engine(tok, model)
    prompt = tok("abc", add_special_tokens=False)["input_ids"]
    ep = _Slow(turns=5)
    engine.add(Request(0, prompt, 40, episode=ep))
    engine.add(Request(1, prompt, 40))  # single-turn: passes through
    done = {}
    steps = 0
    while engine.num_unfinished():
        for r in engine.step():
            done[r.request_id] = r
        steps += 1
        assert steps < 200
    r = done[0]
    spans = turn_spans(r.versions)
    assert r.turns == len(spans) == 3  # max_turns: the third turn ends the episode, unanswered
    env_ids = tok("ab", add_special_tokens=False)["input_ids"]
    for (_, b), (c, _) in zip(spans, spans[1:]):
        assert r.tokens[b:c] == env_ids and r.versions[b:c] == [ENV_VERSION] * 2 and r.logprobs[b:c] == [0.0] * 2
    texts = [scored_text(tok, Request(9, [], 1, tokens=r.tokens[a:b]), [tok.eos_token_id]) for a, b in spans]
    # the environment saw each turn's text before the stop token; the third, cut by max_turns, only when it ended
    # on its stop token (asked whether it would answer it: it would, so the episode is cut short)
    last_stopped = r.tokens[-1] == tok.eos_token_id
    assert ep.seen == texts[: 2 + last_stopped]
    assert not r.finished
    assert r.transcript == "ab".join(texts)
    assert len(r.tokens) == len(r.logprobs) == len(r.versions) <= 40
    # every sampled token's log-prob is the model's on the whole sequence, as the trainer will score it
    full = full_logprobs(model, prompt, r.tokens, 0.7)
    sampled = torch.tensor([v != ENV_VERSION for v in r.versions])
    assert torch.allclose(torch.tensor(r.logprobs)[sampled], full[sampled], atol=1e-4)
    assert done[1].transcript is None and done[1].turns == 1
    # each later turn prefilled only its new tokens over the kept cache (the last sampled token and the reply)
    assert inner.prefill_tokens == 2 * len(prompt) + sum(c - b + 1 for (_, b), (c, _) in zip(spans, spans[1:]))
    assert not inner.parked


def test_kept_caches_stay_within_their_budget_and_a_dropped_one_is_prefilled_again(engine_parts):
    """Three finished turns keep their caches under a budget that holds two: the oldest is dropped. The next turn
    of a kept one prefills only its new tokens; the dropped one's prefills its whole history, and both sample with
    the log-probs of the model over the whole sequence."""
    tok, model = engine_parts
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("abcd", "bcda", "cdab")]
    engine = ReferenceEngine(model, 4, 64, [tok.eos_token_id], 1.0, seed=0, max_parked_tokens=2 * (4 + 3 - 1))
    assert ReferenceEngine(model, 4, 64, [tok.eos_token_id], 1.0).max_parked_tokens == 4 * 64  # the slot cache's
    for i, p in enumerate(prompts):
        first = Request(i, p, 3)
        first.keep_cache = True
        engine.add(first)
        done = [r for _ in range(10) for r in engine.step()]
        assert [r.request_id for r in done] == [i]
        prompts[i] = p + done[0].tokens  # the history the next turn continues
    assert list(engine.parked) == [1, 2] and engine.parked_dropped == 1
    assert sum(len(x.ids) for x in engine.parked.values()) <= engine.max_parked_tokens
    for i, prefilled in [(2, 1), (0, len(prompts[0]))]:  # kept: the last sampled token; dropped: everything
        nxt = Request(10 + i, prompts[i], 2)
        nxt.continues = i
        engine.add(nxt)
        before = engine.prefill_tokens
        (r,) = [x for _ in range(10) for x in engine.step()]
        assert engine.prefill_tokens - before == prefilled
        full = full_logprobs(model, prompts[i], r.tokens, 1.0)
        assert torch.allclose(torch.tensor(r.logprobs), full, atol=1e-4)
    assert list(engine.parked) == [1]


class _NoBuckets:
    """A weight receiver whose update the test already loaded into the engine."""

    def receive_buckets(self) -> None:
        return None


@pytest.mark.parametrize("kv_max_age", [-1, 0])
def test_an_update_between_turns_gives_the_next_turn_the_new_version(engine_parts, kv_max_age):
    """The update lands while the environment answers: the next turn's tokens carry the new version. Its cache is
    the first turn's, kept (kv_max_age -1: the new weights prefill only the last sampled token and the reply) or
    recomputed (0: the whole history prefilled under the new weights), and its log-probs are those of that cache."""
    tok, model = engine_parts
    engine, inner = _turn_engine(tok, model, max_turns=2, turn_tokens=4, temperature=1.0)
    prompt = tok("abc", add_special_tokens=False)["input_ids"]
    engine.add(Request(0, prompt, 30, episode=_Slow(turns=2)))
    while not engine._replying:  # the first turn generates under version 0
        assert not engine.step()
    assert len(inner.parked) == 1  # its cache waits for the next turn
    old, new = copy.deepcopy(model), build_model(model.args, seed=1)  # the engine's model takes new's weights
    inner.load_weights(list(new.state_dict().items()))
    assert inner.load_update(_NoBuckets(), 1, kv_max_age) == (kv_max_age == 0)
    before = inner.prefill_tokens
    (r,) = [x for _ in range(100) for x in engine.step()][:1]
    (a, b), (c, d) = turn_spans(r.versions)
    assert set(r.versions[a:b]) == {0} and set(r.versions[c:d]) == {1}
    if kv_max_age < 0:
        expected = logprobs_old_kv_then_new(old, new, prompt, r.tokens, b, 1.0)[c - b : d - b]
        assert inner.prefill_tokens - before == c - b + 1  # the last sampled token and the environment's reply
    else:
        expected = full_logprobs(new, prompt, r.tokens, 1.0)[c:d]
        assert inner.prefill_tokens - before == len(prompt) + c
    assert torch.allclose(torch.tensor(r.logprobs[c:d]), expected, atol=1e-4)
    assert not inner.parked  # the episode ended: nothing kept


class _Scripted(Engine):
    """An engine that answers each request with the next scripted turn (text + EOS), one step after it was added;
    single-turn requests get `filler` tokens, one per step, so that they keep generating meanwhile."""

    def __init__(self, tok, turns: list[str], filler_steps: int) -> None:
        self.tok, self.turns, self.filler_steps = tok, list(turns), filler_steps
        self.reqs: list[Request] = []
        self.steps = 0

    @classmethod
    def create(cls, settings):  # pragma: no cover - not built by a factory
        raise NotImplementedError

    def add(self, request: Request) -> None:
        self.reqs.append(request)

    def step(self) -> list[Request]:
        self.steps += 1
        done = []
        for r in list(self.reqs):
            if r.request_id >= TURN_RID_BASE:
                r.tokens = self.tok(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                r.logprobs, r.versions, r.finished = [-0.5] * len(r.tokens), [0] * len(r.tokens), True
            else:
                r.tokens.append(3)
                r.logprobs.append(-1.0)
                r.versions.append(0)
                if len(r.tokens) < self.filler_steps:
                    continue
            self.reqs.remove(r)
            done.append(r)
        return done

    def num_unfinished(self) -> int:
        return len(self.reqs)

    def stats(self):
        return 0, 0.0, 0.0

    def load_update(self, receiver, version, kv_max_age):
        return 0

    def stage_update(self, receiver):
        pass

    def apply_staged(self, version):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(
    "call, outcome, reply",
    [
        ("C:12+34+56", "ok", "R:102\n"),
        ("C:__import__('time').sleep(60)", "tool_timeout", "R:?\n"),
        ("C:1/0", "tool_error", "R:?\n"),
        ("C:len(bytearray(10**10))", "tool_error", "R:?\n"),  # over the memory limit
        ("C:'7'*(10**6)", "tool_output_truncated", "R:?\n"),
    ],
)
def test_a_tool_call_gives_its_outcome_within_its_deadline_while_the_engine_keeps_generating(call, outcome, reply):
    """A tool-arithmetic episode calls the sandboxed tool; whatever the call does (answer, hang, raise, flood), its
    reply comes back with its named outcome within the deadline, and a single-turn request beside it finishes
    meanwhile: the tool never stalls generation."""
    task = ToolArithmetic(ToolArithmeticConfig(tool_timeout_s=2.0, tool_output_bytes=1024))
    tok = build_char_tokenizer(task.alphabet + "_(')*/.imporstlenbyaw")
    inner = _Scripted(tok, [call, "A:102"], filler_steps=40)
    engine = TurnEngine(inner, tok, TokenizerConfig(), [tok.eos_token_id], max_turns=3, turn_tokens=40)
    engine.add(
        Request(0, tok("12+34+56=", add_special_tokens=False)["input_ids"], 100, episode=task.start_episode("102"))
    )
    engine.add(Request(1, [3], 100))
    done, t0 = {}, time.perf_counter()
    while engine.num_unfinished():
        for r in engine.step():
            done[r.request_id] = (r, time.perf_counter() - t0, inner.steps)
        time.sleep(0.01)
        assert time.perf_counter() - t0 < 30
    episode, took, _ = done[0]
    assert episode.transcript == f"{call}{reply}A:102" and episode.turns == 2
    assert engine.tool_outcomes == {outcome: 1}
    assert took < 2.0 + 3.0  # the deadline, plus the interpreter's start on a loaded machine
    assert task.reward(episode.transcript, "102") == 1.0
    if outcome == "tool_timeout":  # the single-turn request was not held up while the tool hung
        assert done[1][2] < done[0][2]


@pytest.mark.parametrize(
    "max_turns, max_tokens, env_turns, finished",
    [
        (2, 40, 5, False),  # max_turns reached on a turn the environment would answer: truncated
        (2, 40, 2, True),  # ... on the turn that ends it: finished
        (5, 3, 5, False),  # the budget used up by a finished turn the environment would answer
        (5, 3, 1, True),  # ... that ends it
    ],
)
def test_an_episode_cut_by_a_limit_is_finished_only_if_its_environment_was_done(
    engine_parts, max_turns, max_tokens, env_turns, finished
):
    tok, _ = engine_parts
    engine = TurnEngine(_Scripted(tok, ["ab"] * 5, 1), tok, TokenizerConfig(), [tok.eos_token_id], max_turns, 4)
    engine.add(Request(0, [3], max_tokens, episode=_Counting(env_turns)))
    (r,) = [x for _ in range(20) for x in engine.step()]
    assert r.turns == min(max_turns, max_tokens // 3) and r.finished is finished


def test_a_tool_call_left_unanswered_at_max_turns_is_not_run_and_cuts_the_episode_short():
    class _Calls:  # the episode's tool mailbox: records what it is asked to run
        def __init__(self) -> None:
            self.submitted: list[str] = []

        def submit(self, key, code: str) -> None:
            self.submitted.append(code)

    tok = build_char_tokenizer(ToolArithmetic.alphabet)
    engine = TurnEngine(_Scripted(tok, ["C:1+2"], 1), tok, TokenizerConfig(), [tok.eos_token_id], 1, 40)
    calls = _Calls()
    episode = ToolEpisode(calls, 0)
    engine.add(Request(0, tok("1+2=", add_special_tokens=False)["input_ids"], 100, episode=episode))
    (r,) = [x for _ in range(5) for x in engine.step()]
    assert r.transcript == "C:1+2" and not r.finished
    assert calls.submitted == [] and not engine.tool_outcomes  # the call was not run
    assert not episode.would_reply("A:3", True) and not episode.would_reply("C:1+2", False)
    episode.submit("C:1+2", True)
    assert calls.submitted == ["print(1+2)"]


def test_tool_arithmetic_reference_transcripts_call_the_tool_or_work_the_sum():
    task = ToolArithmetic(ToolArithmeticConfig())
    rng = random.Random(0)
    kinds = set()
    for _ in range(100):
        p = task.sample(rng)
        turns = task.supervised_turns(p)
        kinds.add(len(turns))
        assert task.reward("".join(turns), p.answer) == 1.0
        if len(turns) == 3:
            assert turns[0] == "C:" + p.prompt[:-1] and turns[1] == f"R:{p.answer}\n"
    assert kinds == {1, 3}


def test_the_docs_environment_example_registers_and_runs_its_episodes(monkeypatch):
    """docs/extending.md's environment, run as written: registered by name, its reference transcript trains only the
    model's turns, and an episode driven through the TurnEngine reproduces it and earns reward 1."""
    import re
    from pathlib import Path

    from pipelinerl_fsdp.tasks import base

    monkeypatch.setattr(base, "TASKS", dict(base.TASKS))  # the example's registration stays in this test
    doc = (Path(__file__).resolve().parents[3] / "docs" / "extending.md").read_text()
    (code,) = [
        c for c in re.findall(r"```python\n(.*?)```", doc, re.S) if c.startswith("# pipelinerl_fsdp/tasks/count")
    ]
    namespace: dict = {}
    exec(compile(code, "count_down.py", "exec"), namespace)
    cls = base.TASKS["count_down"]
    task = cls(namespace["CountDownConfig"]())
    assert task.multi_turn
    p = task.sample(random.Random(3))
    turns = task.supervised_turns(p)
    tok = build_char_tokenizer(task.alphabet)
    engine = TurnEngine(_Scripted(tok, turns[0::2], 1), tok, TokenizerConfig(), [tok.eos_token_id], 10, 4)
    engine.add(
        Request(0, tok(p.prompt, add_special_tokens=False)["input_ids"], 60, episode=task.start_episode(p.answer))
    )
    (r,) = [x for _ in range(50) for x in engine.step()]
    assert r.transcript == p.solution and task.reward(r.transcript, p.answer) == 1.0
    _, mask = encode_supervised(tok, p, TokenizerConfig(), task)
    assert sum(mask) == sum(len(t) + 1 for t in turns[0::2])  # each model turn and its stop token
