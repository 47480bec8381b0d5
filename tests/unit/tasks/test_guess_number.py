"""guess_number's edge cases: the environment and the reward read a turn the same way, and a game whose opening
prompt is always the same (a fixed range, another hidden number) has a held-out split, runs and evaluates."""

from __future__ import annotations

import re

import pytest

from pipelinerl_fsdp.config import EvalConfig, TokenizerConfig
from pipelinerl_fsdp.inference.engine import Engine, Request
from pipelinerl_fsdp.inference.evaluator import EngineEvaluator, evaluate_alone
from pipelinerl_fsdp.inference.turns import TurnEngine
from pipelinerl_fsdp.rewards.scorer import InlineScorer
from pipelinerl_fsdp.tasks import ProblemStream
from pipelinerl_fsdp.tasks.guess_number import GuessNumber, GuessNumberConfig
from pipelinerl_fsdp.tokenizer import build_char_tokenizer

ONE_RANGE = GuessNumberConfig(min_start=1, max_start=1, min_size=100, max_size=100, eval_size=20)


def _play(task: GuessNumber, answer: str, turns: list[str]) -> tuple[str, bool]:
    """Run `turns` through an episode as the turn engine does: the transcript and whether the episode ended on the
    last turn (rather than asking for more)."""
    ep, transcript = task.start_episode(answer), ""
    for turn in turns:
        transcript += turn
        reply = ep.respond(turn, True)
        if reply.text is None:
            return transcript, True
        transcript += reply.text
    return transcript, False


@pytest.mark.parametrize(
    "turns, reward",
    [
        (["20", "31"], 1.0),
        (["20", "31\n"], 1.0),  # the environment ends on a right guess with a newline: the reward finds it too
        ([" 20 ", "\n31\n"], 1.0),
        (["20\n", "25", "28", "29", "30", "31"], 0.5),
        (["20", "3a"], 0.0),  # not a guess: ends, unsolved
        (["20", "31>"], 0.0),
        (["20>\n31"], 1.0),  # a turn writing the true reply itself reads as the two turns it imitates
        (["20<\n31"], 0.0),  # ... a false reply scores nothing
        (["31>\n31"], 0.0),  # ... nor does a right guess passed over
    ],
)
def test_the_reward_reads_turns_as_the_environment_does(turns, reward):
    task = GuessNumber(GuessNumberConfig(max_turns=6))
    transcript, ended = _play(task, "31;5", turns)
    assert ended
    assert task.reward(transcript, "31;5") == reward


def test_one_opening_prompt_holds_out_hidden_numbers():
    task = GuessNumber(ONE_RANGE)
    split = task.eval_split()
    assert {p.prompt for p in split} == {"1-100:"} and len({p.answer for p in split}) == 20
    held_out = {task.problem_id(p) for p in split}
    stream = ProblemStream(task, seed=0)
    train = [next(stream) for _ in range(300)]
    assert {p.prompt for p in train} == {"1-100:"}
    assert not held_out & {task.problem_id(p) for p in train}
    assert len({p.answer for p in train}) > 50  # the other hidden numbers all train
    for p in split + train:
        assert 1 <= int(p.answer.split(";")[0]) <= 100 and task.reward(p.solution, p.answer) >= 0.5
    everything = GuessNumber(GuessNumberConfig(min_start=1, max_start=1, min_size=4, max_size=4, eval_size=4))
    with pytest.raises(ValueError, match="no training problem outside the held-out split"):
        everything.train_problem(0, 0)
    assert ("max_start", "in [task.min_start, 1000 - task.max_size] (guesses have at most 3 digits)") in (
        GuessNumberConfig(min_start=5, max_start=4).check()
    )


class _Bisector(Engine):
    """A policy that bisects: each turn reads the range and the replies from the history and guesses the middle
    of what is left (text + EOS), one step after it was asked."""

    def __init__(self, tok) -> None:
        self.tok, self.reqs = tok, []

    @classmethod
    def create(cls, settings):  # pragma: no cover - not built by a factory
        raise NotImplementedError

    def add(self, request: Request) -> None:
        self.reqs.append(request)

    def step(self) -> list[Request]:
        done, self.reqs = self.reqs, []
        eos = self.tok.eos_token_id
        for r in done:
            history = self.tok.decode(r.prompt_ids, skip_special_tokens=True)
            lo, hi = map(int, re.match(r"(\d+)-(\d+):", history).groups())
            for guess, sign in re.findall(r"(\d+)([<>])\n", history[history.index(":") + 1 :]):
                lo, hi = (int(guess) + 1, hi) if sign == ">" else (lo, int(guess) - 1)
            r.tokens = self.tok(str((lo + hi) // 2), add_special_tokens=False)["input_ids"] + [eos]
            r.logprobs, r.versions, r.finished = [-0.1] * len(r.tokens), [0] * len(r.tokens), True
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


def test_a_game_with_one_opening_prompt_runs_and_evaluates():
    """Held-out evaluation of the fixed-range game on the turn engine: 20 hidden numbers behind one prompt, each
    episode played to its end; bisection solves every one within the bound (pass@1 = 1)."""
    task = GuessNumber(ONE_RANGE)
    tok = build_char_tokenizer(task.alphabet)
    stop = [tok.eos_token_id]
    c = task.cfg
    engine = TurnEngine(_Bisector(tok), tok, TokenizerConfig(), stop, c.max_turns, c.turn_tokens)
    evaluator = EngineEvaluator(
        EvalConfig(every=1, samples=2),
        TokenizerConfig(),
        task,
        tok,
        0,
        1,
        final_version=1,
        max_new_tokens=c.max_new_tokens,
    )
    [report] = evaluate_alone(evaluator, engine, InlineScorer(task.reward), tok, stop, 1, 8)
    assert report.problems == list(range(20)) and report.correct == [2] * 20
