"""A dialogue game over several turns: guess a hidden number from higher / lower feedback.

The prompt gives the range ("12-40:"); each model turn is a guess ("27"), and the environment answers ">\\n"
(the number is higher) or "<\\n" (lower), or ends the episode when the guess is right. A transcript reads
"27>\\n35<\\n31". Reward: 1 for finding the number within the bisection bound (ceil(log2(range size)) guesses),
0.5 for finding it later within `task.max_turns`, 0 otherwise (including a turn that is not a number); held-out
success (pass@1) counts reward 1 only. Episodes vary in turn count as well as in length.

The warm start's reference transcripts guess uniformly at random inside the range the feedback leaves (they
always find the number, in more guesses than bisection needs on average), so the warm policy solves within the
bound only some of the time: RL has to discover bisection.
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


@dataclass
class GuessNumberConfig(EnvironmentConfig):
    min_size: int = 16  # numbers in a game's range, at least
    max_size: int = 32  # ... and at most
    max_start: int = 69  # the range's first number lies in [0, max_start]
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
        if self.max_start < 0 or self.max_start + self.max_size > 1000:
            bad.append(("max_start", "in [0, 1000 - task.max_size] (guesses have at most 3 digits)"))
        return bad


def bisection_bound(size: int) -> int:
    """Guesses that bisection needs at most to find a number among `size`."""
    return math.ceil(math.log2(size + 1))


class GuessEpisode(Episode):
    def __init__(self, secret: int) -> None:
        super().__init__()
        self.secret = secret

    def respond(self, turn: str, finished: bool) -> Reply:
        m = _LINE.fullmatch(turn.strip()) if finished else None
        if m is None or m.group(2) or int(m.group(1)) == self.secret:
            return Reply(None)  # solved, or not a guess: the episode ends
        return Reply(">\n" if self.secret > int(m.group(1)) else "<\n")


@register_task("guess_number")
class GuessNumber(GeneratedTask):
    """Find a hidden number in a range from higher / lower answers (see the module docstring)."""

    config_class = GuessNumberConfig
    alphabet = ALPHABET
    cfg: GuessNumberConfig

    def sample(self, rng: random.Random) -> Problem:
        c = self.cfg
        lo = rng.randint(0, c.max_start)
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
        """Replays the transcript: every line a guess and its feedback, the last the right guess."""
        secret, bound = map(int, answer.split(";"))
        lines = completion.split("\n")
        for line in lines[:-1]:
            m = _LINE.fullmatch(line)
            if m is None or not m.group(2):
                return 0.0
        last = _LINE.fullmatch(lines[-1])
        if last is None or last.group(2) or int(last.group(1)) != secret or len(lines) > self.cfg.max_turns:
            return 0.0
        return 1.0 if len(lines) <= bound else 0.5

    def longest_prompt(self) -> str:
        hi = self.cfg.max_start + self.cfg.max_size - 1
        return f"{self.cfg.max_start}-{hi}:"
