"""Arithmetic tasks with verifiable answers: fixed-length addition and variable-length chains of sums.

`addition` (e.g. "123+456=" -> "579") has answers of nearly uniform length. `chain_sum` adds k terms with k drawn
from a range and writes every partial sum on its own line before the answer, so completion lengths vary several
fold: the long-tail regime where PipelineRL's in-flight updates matter most.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from torchdata.nodes import BaseNode

# Every character any arithmetic prompt or solution uses; the character tokenizer is built from it.
ALPHABET = "0123456789+=:A\n"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the verifiable final answer
    solution: str  # a reference completion (without EOS), for the supervised warm start


class Task(ABC):
    """A problem generator with an exact reward and a fixed held-out split disjoint from training problems."""

    name: str
    alphabet: str = ALPHABET

    def __init__(self, eval_size: int = 500, eval_seed: int = 1234) -> None:
        self.eval_size, self.eval_seed = eval_size, eval_seed
        self._eval: list[Problem] | None = None
        self._eval_prompts: set[str] = set()

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem: ...

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for a correct completion (text before EOS), else 0.0."""

    def eval_split(self) -> list[Problem]:
        """The held-out evaluation problems: fixed by (eval_seed, eval_size), distinct prompts."""
        if self._eval is None:
            rng = random.Random(f"eval:{self.name}:{self.eval_seed}")
            seen: dict[str, Problem] = {}
            tries = 0
            while len(seen) < self.eval_size:
                p = self.sample(rng)
                seen.setdefault(p.prompt, p)
                tries += 1
                if tries > 100 * self.eval_size:
                    raise ValueError(f"task {self.name}: cannot draw {self.eval_size} distinct eval problems")
            self._eval = list(seen.values())
            self._eval_prompts = set(seen)
        return self._eval

    def train_problem(self, seed: int, index: int) -> Problem:
        """Training problem number `index` of the stream `seed`: deterministic, never in the eval split."""
        self.eval_split()
        rng = random.Random(f"train:{self.name}:{seed}:{index}")
        while True:
            p = self.sample(rng)
            if p.prompt not in self._eval_prompts:
                return p


def _number(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


class Addition(Task):
    """a+b with `digits`-digit operands: "123+456=" -> "579"."""

    name = "addition"

    def __init__(self, digits: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.digits = digits

    def sample(self, rng: random.Random) -> Problem:
        a, b = _number(rng, self.digits), _number(rng, self.digits)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=str(a + b))

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)


class ChainSum(Task):
    """k-term sums worked step by step: "3+14+7=" -> "3+14=17\\n17+7=24\\nA:24"; k in [min_terms, max_terms]."""

    name = "chain_sum"

    def __init__(self, digits: int = 2, min_terms: int = 2, max_terms: int = 8, **kw: Any) -> None:
        super().__init__(**kw)
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"chain_sum needs 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        self.digits, self.min_terms, self.max_terms = digits, min_terms, max_terms

    def sample(self, rng: random.Random) -> Problem:
        terms = [_number(rng, self.digits) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        steps, total = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{total}+{t}={total + t}")
            total += t
        return Problem(prompt="+".join(map(str, terms)) + "=", answer=str(total),
                       solution="\n".join(steps) + f"\nA:{total}")

    def reward(self, problem: Problem, completion: str) -> float:
        text = completion.rstrip()
        if "A:" not in text:
            return 0.0
        return float(text.rsplit("A:", 1)[1] == problem.answer)


TASKS: dict[str, type[Task]] = {"addition": Addition, "chain_sum": ChainSum}


def make_task(name: str, **kw: Any) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**kw)


class ProblemStream(BaseNode[Problem]):
    """An endless, resumable stream of training problems (torchdata node; state = next index).

    With several consumers (data-parallel ranks, inference ranks) each takes every `stride`-th index from
    `offset`, so the streams are disjoint and together cover the same sequence.
    """

    def __init__(self, task: Task, seed: int, offset: int = 0, stride: int = 1) -> None:
        super().__init__()
        self.task, self.seed, self.offset, self.stride = task, seed, offset, stride
        self._index = offset

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._index = self.offset if initial_state is None else int(initial_state["index"])

    def next(self) -> Problem:
        p = self.task.train_problem(self.seed, self._index)
        self._index += self.stride
        return p

    def get_state(self) -> dict[str, Any]:
        return {"index": self._index}
