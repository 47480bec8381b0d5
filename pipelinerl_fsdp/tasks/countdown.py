"""`countdown`: long worked generations with a heavy-tailed length, and their uniform twin.

"0457-3>0430=" asks to count down from 457 in steps of 3 to 430, writing every value on its own zero-padded line:
"0454\\n0451\\n...\\n0430". Every line is a verifiable step (a 4-digit subtraction of one digit and a comparison with
the prompt's end value), so the reward is exact: 1 when the whole worked solution is right, else 0. A problem of L
lines has exactly 5L completion tokens (EOS included) with the task's character tokenizer, so the length of a
completion is chosen by the generator, not by the model's luck:

- `lengths = "tail"`: L drawn with P(L) proportional to L^-tail_exponent on [min_lines, max_lines] (defaults 4..205:
  20..1,025 tokens, median ~60, mean ~143: the longest 17x the median). The paper's regime: a few sequences live
  through many optimizer steps while most finish within one.
- `lengths = "uniform"`: the same problems' twin with nearly equal lengths, L uniform within +-uniform_spread of
  the tail distribution's mean line count, so the mean completion length is the same.

Why this task (docs/results.md, the long-generation regime): each step is local (the line above, the step and the
end value in the prompt) so the ~0.8M debug model learns it from a short warm start and keeps long chains right
often enough to learn from, where long chains of sums compound errors to zero; and the problem space is large at
every length (the end value is free), so the uniform twin's held-out set is disjoint from its training stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.tasks.base import GeneratedTask, Problem, register_task

ALPHABET = "0123456789->=\n"
WIDTH = 4  # digits of every value (zero-padded): lines of WIDTH + 1 characters
TOP = 10**WIDTH - 1
LENGTHS = ("tail", "uniform")


def tail_weights(min_lines: int, max_lines: int, exponent: float) -> list[float]:
    """Unnormalised P(L) = L^-exponent for L = min_lines..max_lines."""
    return [n**-exponent for n in range(min_lines, max_lines + 1)]


def tail_mean(min_lines: int, max_lines: int, exponent: float) -> float:
    """Mean line count of the tail distribution."""
    w = tail_weights(min_lines, max_lines, exponent)
    return sum(n * x for n, x in zip(range(min_lines, max_lines + 1), w)) / sum(w)


def uniform_band(min_lines: int, max_lines: int, exponent: float, spread: float) -> tuple[int, int]:
    """The uniform twin's line counts: the tail distribution's mean +- `spread` of it (at least one line apart)."""
    mean = tail_mean(min_lines, max_lines, exponent)
    half = max(1, round(mean * spread))
    return max(1, round(mean) - half), round(mean) + half


@dataclass
class CountdownConfig(TaskConfig):
    lengths: str = "tail"
    min_lines: int = 4
    max_lines: int = 205
    tail_exponent: float = 1.5
    uniform_spread: float = 0.1
    max_step: int = 9
    max_new_tokens: int = 1032

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if self.lengths not in LENGTHS:
            bad.append(("lengths", " or ".join(map(repr, LENGTHS))))
        if self.min_lines < 1:
            bad.append(("min_lines", ">= 1"))
        if self.max_lines < self.min_lines:
            bad.append(("max_lines", f">= task.min_lines = {self.min_lines}"))
        if not 1 <= self.max_step <= 9:
            bad.append(("max_step", "between 1 and 9 (one digit)"))
        elif self.max_lines * self.max_step > TOP:
            bad.append(("max_lines", f"<= {TOP // self.max_step} (values have {WIDTH} digits)"))
        if self.tail_exponent < 0:
            bad.append(("tail_exponent", ">= 0"))
        if not 0 <= self.uniform_spread < 1:
            bad.append(("uniform_spread", "in [0, 1)"))
        longest = (self.max_lines if self.lengths == "tail" else self.line_range()[1]) * (WIDTH + 1)
        if self.max_new_tokens < longest:
            bad.append(("max_new_tokens", f">= {longest} (the longest solution, EOS included)"))
        return bad

    def line_range(self) -> tuple[int, int]:
        """Fewest and most lines a problem has under `lengths`."""
        if self.lengths == "uniform":
            return uniform_band(self.min_lines, self.max_lines, self.tail_exponent, self.uniform_spread)
        return self.min_lines, self.max_lines


@register_task("countdown")
class Countdown(GeneratedTask):
    """Count down from n in steps of d to f, one zero-padded value per line; L = (n - f) / d lines."""

    config_class = CountdownConfig
    alphabet = ALPHABET
    cfg: CountdownConfig

    def __init__(self, cfg: TaskConfig) -> None:
        super().__init__(cfg)
        lo, hi = self.cfg.line_range()
        self._lines = list(range(lo, hi + 1))
        self._weights = (
            tail_weights(lo, hi, self.cfg.tail_exponent) if self.cfg.lengths == "tail" else [1.0] * len(self._lines)
        )

    def sample(self, rng: random.Random) -> Problem:
        lines = rng.choices(self._lines, self._weights)[0]
        step = rng.randint(1, self.cfg.max_step)
        end = rng.randint(0, TOP - lines * step)
        start = end + lines * step
        values = [start - step * i for i in range(1, lines + 1)]
        solution = "\n".join(f"{v:0{WIDTH}d}" for v in values)
        return Problem(prompt=f"{start:0{WIDTH}d}-{step}>{end:0{WIDTH}d}=", answer=solution, solution=solution)

    def reward(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    def longest_prompt(self) -> str:
        return f"{TOP}-9>{TOP}="
