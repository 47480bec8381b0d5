"""Arithmetic word problems of graded difficulty, for a small pretrained chat model (SmolLM2-135M-Instruct).

Short English problems with one integer answer, drawn from templates by level:
- level 1: one addition or subtraction ("Ana has 7 apples. She buys 5 more. How many apples does she have now?");
- level 2: one multiplication or exact division;
- level 3: two steps (an addition or subtraction after a product, or two additions/subtractions).
The prompt asks for the answer as the last thing written ("The answer is N."); the reward is 1 when the last
integer in the completion equals the gold answer, so a model is not scored on a format it was never taught, and
RL can move it towards ending with the right number. Problems are generated from a seed (no files), the held-out
split is fixed by (eval_seed, eval_size) and disjoint from training problems.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.tasks.base import GeneratedTask, Problem, register_task

NAMES = ("Ana", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira", "Liam")
PRONOUNS = {n: ("She" if n in ("Ana", "Carla", "Emma", "Grace", "Ines", "Kira") else "He") for n in NAMES}
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "coins", "stamps")
CONTAINERS = ("boxes", "bags", "packs", "jars", "baskets")
LEVELS = (1, 2, 3)
_INT = re.compile(r"-?\d[\d,]*")
SUFFIX = "Solve it briefly, then end with: The answer is <number>."


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators allowed), None when there is none."""
    found = _INT.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


def _level1(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, top), rng.randint(1, top)
    if rng.random() < 0.5:
        return (
            f"{name} has {a} {item}. {PRONOUNS[name]} gets {b} more. How many {item} does {name} have now?",
            a + b,
        )
    a, b = max(a, b) + 1, min(a, b)
    friend = rng.choice([n for n in NAMES if n != name])
    return f"{name} has {a} {item} and gives {b} to {friend}. How many {item} does {name} have left?", a - b


def _level2(rng: random.Random, top: int) -> tuple[str, int]:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, max(2, top // 2)), rng.randint(2, 10)
    if rng.random() < 0.5:
        return f"{name} buys {a} {box} with {b} {item} in each. How many {item} does {name} buy?", a * b
    return f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?", a


def _level3(rng: random.Random, top: int) -> tuple[str, int]:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    if rng.random() < 0.5:
        a, b, c = rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, top)
        return (
            f"{name} has {c} {item}. {PRONOUNS[name]} buys {a} {box} with {b} {item} in each. "
            f"How many {item} does {name} have now?",
            c + a * b,
        )
    a, b = rng.randint(5, top), rng.randint(1, top)
    c = rng.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, finds {b} more, then gives {c} away. How many {item} does {name} have left?",
        a + b - c,
    )


GENERATORS = {1: _level1, 2: _level2, 3: _level3}


@dataclass
class WordProblemsConfig(TaskConfig):
    # difficulty levels drawn from, uniformly (1: one add/subtract, 2: one multiply/divide, 3: two steps)
    levels: list[int] = field(default_factory=lambda: [1, 2, 3])
    # largest number a problem starts from (sums and products may exceed it)
    max_number: int = 20
    # appended to every problem (the instruction the reward relies on: the answer written last)
    instruction: str = SUFFIX
    max_new_tokens: int = 96

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if not self.levels or any(lv not in LEVELS for lv in self.levels):
            bad.append(("levels", f"a non-empty list of levels from {list(LEVELS)}"))
        if self.max_number < 5:
            bad.append(("max_number", ">= 5"))
        return bad


@register_task("word_problems")
class WordProblems(GeneratedTask):
    """One- and two-step arithmetic word problems; reward: the completion's last integer is the answer."""

    config_class = WordProblemsConfig
    cfg: WordProblemsConfig

    def sample(self, rng: random.Random) -> Problem:
        level = rng.choice(self.cfg.levels)
        question, answer = GENERATORS[level](rng, self.cfg.max_number)
        prompt = f"{question}\n{self.cfg.instruction}" if self.cfg.instruction else question
        return Problem(prompt=prompt, answer=str(answer), solution=f"The answer is {answer}.")

    def reward(self, completion: str, answer: str) -> float:
        return float(last_integer(completion) == int(answer))

    def longest_prompt(self) -> str:
        # the longest template with the longest name, item and container, and numbers of the most digits
        wide = "9" * (len(str(self.cfg.max_number * 10)) + 1)
        name, item = max(NAMES, key=len), max(ITEMS, key=len)
        question = (
            f"{name} has {wide} {item}. She buys {wide} {max(CONTAINERS, key=len)} with {wide} {item} in each. "
            f"How many {item} does {name} have now? {name} has {wide} {item}, finds {wide} more, then gives {wide}"
        )
        return f"{question}\n{self.cfg.instruction}"
