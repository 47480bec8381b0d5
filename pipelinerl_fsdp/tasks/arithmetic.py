"""Arithmetic tasks with verifiable answers: fixed-length addition and variable-length chains of sums.

`addition` (e.g. "123+456=" -> "579") has answers of nearly uniform length. `chain_sum` adds k terms with k drawn
from a range and writes every partial sum on its own line before the answer, so completion lengths vary several
fold: the long-tail regime where PipelineRL's in-flight updates matter most.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.tasks.base import GeneratedTask, Problem, register_task

# Every character any arithmetic prompt or solution uses; the character tokenizer is built from it.
ALPHABET = "0123456789+=:A\n"


def _number(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


@dataclass
class AdditionConfig(TaskConfig):
    digits: int = 3

    def check(self) -> list[tuple[str, str]]:
        return super().check() + ([("digits", "between 1 and 18")] if not 1 <= self.digits <= 18 else [])


@register_task("addition")
class Addition(GeneratedTask):
    """a+b with `digits`-digit operands: "123+456=" -> "579"."""

    config_class = AdditionConfig
    alphabet = ALPHABET
    cfg: AdditionConfig

    def sample(self, rng: random.Random) -> Problem:
        a, b = _number(rng, self.cfg.digits), _number(rng, self.cfg.digits)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=str(a + b))

    def reward(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    def longest_prompt(self) -> str:
        n = "9" * self.cfg.digits
        return f"{n}+{n}="


@dataclass
class ChainSumConfig(TaskConfig):
    digits: int = 2
    min_terms: int = 2
    max_terms: int = 8
    max_new_tokens: int = 96

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if not 1 <= self.digits <= 18:
            bad.append(("digits", "between 1 and 18"))
        if self.min_terms < 2:
            bad.append(("min_terms", ">= 2"))
        if self.max_terms < self.min_terms:
            bad.append(("max_terms", f">= task.min_terms = {self.min_terms}"))
        return bad


@register_task("chain_sum")
class ChainSum(GeneratedTask):
    """k-term sums worked step by step: "3+14+7=" -> "3+14=17\\n17+7=24\\nA:24"; k in [min_terms, max_terms]."""

    config_class = ChainSumConfig
    alphabet = ALPHABET
    cfg: ChainSumConfig

    def sample(self, rng: random.Random) -> Problem:
        c = self.cfg
        terms = [_number(rng, c.digits) for _ in range(rng.randint(c.min_terms, c.max_terms))]
        steps, total = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{total}+{t}={total + t}")
            total += t
        return Problem(
            prompt="+".join(map(str, terms)) + "=", answer=str(total), solution="\n".join(steps) + f"\nA:{total}"
        )

    def reward(self, completion: str, answer: str) -> float:
        text = completion.rstrip()
        if "A:" not in text:
            return 0.0
        return float(text.rsplit("A:", 1)[1] == answer)

    def longest_prompt(self) -> str:
        return "+".join(["9" * self.cfg.digits] * self.cfg.max_terms) + "="
