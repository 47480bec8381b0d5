"""A dialogue game over several turns: guess a hidden number from higher / lower feedback.

The prompt gives the range ("12-40:"); each model turn is a guess ("27"), and the environment answers ">\\n"
(the number is higher) or "<\\n" (lower), or ends the episode when the guess is right. A transcript reads
"27>\\n35<\\n31". A guess is a number, spaces and newlines around it allowed (the environment and the reward
read turns the same way, `parse_guess`). Reward: 1 for finding the number within the bisection bound
(ceil(log2(range size)) guesses), 0.5 for finding it later within `task.max_turns`, 0 otherwise (including a turn
that is not a number); held-out success (pass@1) counts reward 1 only. Episodes vary in turn count as well as in length.

The warm start's reference transcripts guess uniformly at random inside the range the feedback leaves (they
always find the number, in more guesses than bisection needs on average), so the warm policy solves within the
bound only some of the time: RL has to discover bisection.

With `task.min_size = task.max_size` and `task.min_start = task.max_start` every game has the same range ("1-100:",
one opening prompt) and only the hidden number differs: problems are told apart by their answer as well as their
prompt (`Task.problem_key`), so the held-out split holds out hidden numbers.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from pipelinerl_fsdp.episodes import Episode, Reply
from pipelinerl_fsdp.tasks.base import EnvironmentConfig, GeneratedTask, Problem, register_task

ALPHABET = "0123456789-:<>\n"
_LINE = re.compile(r"(\d{1,6})([<>]?)")
_GUESS = re.compile(r"\d{1,6}")
# the environment's replies, which separate the model's turns in a transcript
_REPLY = re.compile(r"([<>])\n")


@dataclass
class GuessNumberConfig(EnvironmentConfig):
    min_size: int = 16  # numbers in a game's range, at least
    max_size: int = 32  # ... and at most
    min_start: int = 0  # the range's first number lies in [min_start, max_start]
    max_start: int = 69
    max_turns: int = 8
    turn_tokens: int = 4  # up to 3 digits and the stop token
    max_new_tokens: int = 48  # 8 turns of up to 4 tokens and 7 replies of 2
    eval_size: int = 256

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if self.min_size < 2:
            bad.append(("min_size", ">= 2"))
        if self.max_size < max(self.min_size, 2):
            bad.append(("max_size", f">= task.min_size = {self.min_size} and >= 2"))
        if self.min_start < 0:
            bad.append(("min_start", ">= 0"))
        if self.max_start < max(self.min_start, 0) or self.max_start + self.max_size > 1000:
            bad.append(("max_start", "in [task.min_start, 1000 - task.max_size] (guesses have at most 3 digits)"))
        return bad


def bisection_bound(size: int) -> int:
    """Guesses that bisection needs at most to find a number among `size`."""
    return math.ceil(math.log2(size + 1))


def parse_guess(turn: str) -> int | None:
    """The number a model turn guesses (surrounding spaces and newlines allowed), None when it is no guess."""
    text = turn.strip()
    return int(text) if _GUESS.fullmatch(text) else None


class GuessEpisode(Episode):
    def __init__(self, secret: int) -> None:
        super().__init__()
        self.secret = secret

    def respond(self, turn: str, finished: bool) -> Reply:
        guess = parse_guess(turn) if finished else None
        if guess is None or guess == self.secret:
            return Reply(None)  # solved, or not a guess: the episode ends
        return Reply(">\n" if self.secret > guess else "<\n")


@register_task("guess_number")
class GuessNumber(GeneratedTask):
    """Find a hidden number in a range from higher / lower answers (see the module docstring)."""

    config_class = GuessNumberConfig
    alphabet = ALPHABET
    cfg: GuessNumberConfig

    def sample(self, rng: random.Random) -> Problem:
        c = self.cfg
        lo = rng.randint(c.min_start, c.max_start)
        hi = lo + rng.randint(c.min_size, c.max_size) - 1
        secret = rng.randint(lo, hi)
        a, b, lines = lo, hi, []
        while True:  # a reference transcript: a random guess inside what the feedback leaves, bisecting once
            # only as many turns are left as bisection needs (the transcript stays within max_turns)
            g = (a + b) // 2 if c.max_turns - len(lines) <= bisection_bound(b - a + 1) else rng.randint(a, b)
            if g == secret:
                lines.append(str(g))
                break
            lines.append(f"{g}{'>' if secret > g else '<'}")
            a, b = (g + 1, b) if secret > g else (a, g - 1)
        return Problem(f"{lo}-{hi}:", f"{secret};{bisection_bound(hi - lo + 1)}", "\n".join(lines))

    def start_episode(self, answer: str) -> Episode:
        return GuessEpisode(int(answer.split(";")[0]))

    def supervised_turns(self, problem: Problem) -> list[str]:
        turns = []
        for line in problem.solution.split("\n"):
            m = _LINE.fullmatch(line)
            assert m is not None, line
            turns.append(m.group(1))
            if m.group(2):
                turns.append(m.group(2) + "\n")
        return turns

    def reward(self, completion: str, answer: str) -> float:
        """Replays the transcript: model turns separated by the environment's replies, each turn read as the
        environment reads it (`parse_guess`), every reply the true one for its guess, the last turn the right guess.
        A turn that writes a reply itself is read as the turns it imitates: it gains nothing over playing them."""
        secret, bound = map(int, answer.split(";"))
        parts = _REPLY.split(completion)
        guesses, replies = [parse_guess(t) for t in parts[0::2]], parts[1::2]
        if None in guesses or guesses[-1] != secret or len(guesses) > self.cfg.max_turns:
            return 0.0
        for g, r in zip(guesses, replies):
            if g is None or g == secret or r != (">" if secret > g else "<"):
                return 0.0
        return 1.0 if len(guesses) <= bound else 0.5

    def longest_prompt(self) -> str:
        hi = self.cfg.max_start + self.cfg.max_size - 1
        return f"{self.cfg.max_start}-{hi}:"
