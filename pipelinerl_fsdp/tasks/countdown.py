"""`countdown`: long worked generations with a heavy-tailed length, and their uniform twin.

"0457-3:009=" asks to count down from 457 in steps of 3, nine times, writing every value with the number of steps
left, one zero-padded line each: "0454:008\n0451:007\n...\n0430:000". Every line is a verifiable step (two
subtractions: the value by the step, the count by one; the line with count 000 is the last), so the reward is exact:
1 when the whole worked solution is right, else 0. A problem of L lines has exactly 9L completion tokens (EOS
included) with the task's character tokenizer, so a completion's length is chosen by the generator, not by chance:

- `lengths = "tail"`: L drawn with P(L) proportional to L^-tail_exponent on [min_lines, max_lines] (defaults 3..114:
  27..1,026 tokens, median ~72, mean ~153: the longest ~14x the median). The paper's regime: a few sequences live
  through many optimizer steps while most finish within one.
- `lengths = "uniform"`: the twin with nearly equal lengths, L uniform within +-uniform_spread of the tail
  distribution's mean line count, so the mean completion length is the same.

Why this task (docs/results.md, the long-generation regime): every step is local (the line above and the step in
the prompt), so the ~0.8M debug model learns it from a short warm start and gets long chains right often enough to
learn from, where long chains of sums compound errors to zero. The count makes the end local too: a first version
that ended at a value named in the prompt never learned to stop (400 warm-start steps: every completion ran to the
token budget, held-out accuracy 0). The start value is free, so the problem space is large at every length and the
uniform twin's held-out set is disjoint from its training stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.tasks.base import GeneratedTask, Problem, register_task

ALPHABET = "0123456789-:=\n"
WIDTH = 4  # digits of every value (zero-padded)
COUNT_WIDTH = 3  # digits of the steps-left count
LINE_TOKENS = WIDTH + 1 + COUNT_WIDTH + 1  # "vvvv:ccc" and its newline (the last line: EOS)
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
    min_lines: int = 3
    max_lines: int = 114
    tail_exponent: float = 1.5
    uniform_spread: float = 0.1
    max_step: int = 9
    max_new_tokens: int = 1040

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
        elif self.max_lines > min(TOP // self.max_step, 10**COUNT_WIDTH - 1):
            bad.append(
                ("max_lines", f"<= {min(TOP // self.max_step, 10**COUNT_WIDTH - 1)} (values have {WIDTH} digits)")
            )
        if self.tail_exponent < 0:
            bad.append(("tail_exponent", ">= 0"))
        if not 0 <= self.uniform_spread < 1:
            bad.append(("uniform_spread", "in [0, 1)"))
        longest = self.line_range()[1] * LINE_TOKENS
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
    """Count down from n in steps of d, L times: line i is n - i*d and L - i, zero-padded."""

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
        solution = "\n".join(f"{start - step * i:0{WIDTH}d}:{lines - i:0{COUNT_WIDTH}d}" for i in range(1, lines + 1))
        return Problem(prompt=f"{start:0{WIDTH}d}-{step}:{lines:0{COUNT_WIDTH}d}=", answer=solution, solution=solution)

    def reward(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    def longest_prompt(self) -> str:
        return f"{TOP}-9:{10**COUNT_WIDTH - 1}="
