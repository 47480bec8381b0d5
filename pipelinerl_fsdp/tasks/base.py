"""What every task shares: the problem record, the task interface, its config, the registry and the prompt stream.

A task is one module under `pipelinerl_fsdp/tasks/` that defines a `Task` subclass with a `config_class` (a
dataclass extending `TaskConfig` with the task's own keys) and decorates it with `@register_task("name")`. The
package imports every module in this folder, so the task is then selectable with `[task] name = "name"` in a TOML
file, and its keys are checked like every other config key. See docs/extending.md.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torchdata.nodes import BaseNode

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.episodes import Episode
from pipelinerl_fsdp.rewards.scorer import InlineScorer, Scorer


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the verifiable final answer
    solution: str  # a reference completion (without EOS), for the supervised warm start


class Task(ABC):
    """Problems with a reward and a fixed held-out split disjoint from the training problems.

    The rest of the job only uses the methods below. A task that generates its problems subclasses
    `GeneratedTask` (it writes `sample`); a task that reads them from a dataset implements `train_problem` and
    `eval_split` over its records.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[TaskConfig]] = TaskConfig
    # characters of every prompt and solution: a character tokenizer built from them covers the task exactly
    # (empty: the task needs a real tokenizer, from tokenizer.path or the model folder)
    alphabet: ClassVar[str] = ""

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg

    @classmethod
    def check_files(cls, cfg: TaskConfig) -> None:
        """Check the files the task reads, without loading it (a `ConfigError` naming the key and the file): run
        before the job starts any process, so that a missing or malformed data file is reported in seconds. A
        task that reads none has nothing to check."""
        return None

    @abstractmethod
    def train_problem(self, seed: int, index: int) -> Problem:
        """Training problem number `index` of the stream `seed`: deterministic, never in the eval split."""

    @abstractmethod
    def eval_split(self) -> list[Problem]:
        """The held-out evaluation problems (fixed for a given config)."""

    def eval_sets(self) -> dict[str, list[Problem]]:
        """Named held-out sets the engines evaluate (`eval/<name>/...`): by default the split as "heldout"."""
        split = self.eval_split()
        return {"heldout": split} if split else {}

    @abstractmethod
    def reward(self, completion: str, answer: str) -> float:
        """Reward of a completion (its text before the stop token) given the problem's gold answer, 1.0 for a
        correct answer. Called in this process (held-out evaluation); rollouts go through `scorer()`."""

    def scorer(self) -> Scorer:
        """How the inference loop scores rollouts: by default `reward` right away (cheap, exact rewards); a task
        with slow or fragile checking returns a `PoolScorer` (worker processes with deadlines)."""
        return InlineScorer(self.reward)

    @abstractmethod
    def longest_prompt(self) -> str:
        """A prompt at least as long as any this task produces: start-up checks size the budgets from it."""

    # Multi-turn tasks (environments, docs/extending.md): an episode per rollout, answering each model turn.
    def start_episode(self, answer: str) -> Episode | None:
        """A new episode of the problem whose gold answer (the environment's hidden state) is `answer`; None for a
        single-turn task. The reward then scores the whole transcript (model and environment turns' text)."""
        return None

    @property
    def multi_turn(self) -> bool:
        return type(self).start_episode is not Task.start_episode

    def problem_id(self, problem: Problem) -> str:
        """What tells two problems apart (the held-out split against the training stream, the warm start's record
        of what it held out): the prompt; for an environment the prompt and the hidden state its episodes start
        from (`answer`), since one opening prompt may start many games (the same range, another hidden number)."""
        return f"{problem.prompt}\0{problem.answer}" if self.multi_turn else problem.prompt

    def supervised_turns(self, problem: Problem) -> list[str]:
        """The reference solution as turns, model turn first, then environment and model turns alternating (the
        warm start trains on the model's turns only, each ended by the stop token): one turn for single-turn."""
        return [problem.solution]

    def epoch(self, index: int) -> int | None:
        """The data epoch of stream position `index` (None: generated problems have no epochs)."""
        return None

    def environment_missing(self) -> list[str]:
        """What this machine lacks for the task's environment (a tool task: the sandbox's boundary), checked once
        at start-up before anything slow (preflight.check_environment); empty: nothing is missing."""
        return []

    def prompts_to_check(self) -> list[str]:
        """The prompts whose token counts bound every prompt's (a task from files returns all of them, since the
        longest in characters need not be the longest in tokens)."""
        return [self.longest_prompt()]


@dataclass
class EnvironmentConfig(TaskConfig):
    """Keys of every multi-turn task; `max_new_tokens` is the episode's budget after the prompt (model and
    environment tokens), checked against the trainer's micro-batch like any completion's."""

    max_turns: int = 8  # model turns per episode at most
    turn_tokens: int = 16  # tokens per model turn at most (stop token included)

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if self.max_turns < 1:
            bad.append(("max_turns", ">= 1"))
        if not 1 <= self.turn_tokens <= self.max_new_tokens:
            bad.append(("turn_tokens", f"between 1 and task.max_new_tokens = {self.max_new_tokens}"))
        return bad


class GeneratedTask(Task):
    """A task that draws its problems from a seeded generator (`sample`)."""

    def __init__(self, cfg: TaskConfig) -> None:
        super().__init__(cfg)
        self._eval: list[Problem] | None = None
        self._eval_ids: set[str] = set()

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """One random problem."""

    def eval_split(self) -> list[Problem]:
        """Fixed by (eval_seed, eval_size), distinct problems (`problem_id`)."""
        if self._eval is None:
            rng = random.Random(f"eval:{self.name}:{self.cfg.eval_seed}")
            seen: dict[str, Problem] = {}
            tries = 0
            while len(seen) < self.cfg.eval_size:
                p = self.sample(rng)
                seen.setdefault(self.problem_id(p), p)
                tries += 1
                if tries > 100 * self.cfg.eval_size:
                    raise ValueError(
                        f"task {self.name}: cannot draw {self.cfg.eval_size} distinct eval problems "
                        "(task.eval_size is larger than the task's problem space allows)"
                    )
            self._eval = list(seen.values())
            self._eval_ids = set(seen)
        return self._eval

    def train_problem(self, seed: int, index: int) -> Problem:
        self.eval_split()
        rng = random.Random(f"train:{self.name}:{seed}:{index}")
        for _ in range(1000 * max(1, len(self._eval_ids))):
            p = self.sample(rng)
            if self.problem_id(p) not in self._eval_ids:
                return p
        raise ValueError(
            f"task {self.name}: no training problem outside the held-out split (task.eval_size = "
            f"{len(self._eval_ids)} holds out every problem the task's keys allow)"
        )


TASKS: dict[str, type[Task]] = {}
T = TypeVar("T", bound=type[Task])


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: make a Task selectable as `task.name = name`."""

    def deco(cls: T) -> T:
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is registered twice ({TASKS[name].__module__}, {cls.__module__})")
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


class ProblemStream(BaseNode[Problem]):
    """An endless, resumable stream of training problems (torchdata node; state = next index: `state_dict()`,
    `load_state_dict()`).

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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `state_dict()` of a stream with the same task, seed, offset and stride)."""
        self.reset(state)
