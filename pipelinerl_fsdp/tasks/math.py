"""Math word problems with verifiable answers, read from files (the workload of the paper's math runs).

Training and evaluation problems come from local JSONL / parquet / `datasets` folders (`data/`), mapped to a
question and a gold answer by a preset or explicit field names. The prompt wraps the question in
`prompt_template` (the usual "put your final answer within \\boxed{}"); the reward checks the completion's last
`\\boxed{}` against the gold answer with math-verify, in a pool of worker processes with a deadline per answer
(`rewards/`), or runs the user's own `package.module:function` there instead.

Each epoch visits the training problems in a fresh seeded order; stream position `index` is problem
`index mod N` of epoch `index // N`, so positions are resumable and the inference ranks' strided shares disjoint.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipelinerl_fsdp.config import ConfigError, TaskConfig
from pipelinerl_fsdp.data.fields import ANSWER_FORMATS, PRESETS, FieldSpec, field_spec, problem_fields
from pipelinerl_fsdp.data.files import DataError, read_records
from pipelinerl_fsdp.rewards.pool import RewardPool
from pipelinerl_fsdp.rewards.scorer import PoolScorer, Scorer
from pipelinerl_fsdp.tasks.base import Problem, Task, register_task

MATH_VERIFY = "pipelinerl_fsdp.rewards.math_answer:score_math_answer"
# built-in rewards by name; any other value of task.reward is a dotted path to the user's function
BUILTIN_REWARDS = {
    "math_verify": MATH_VERIFY,
    "exact_match": "pipelinerl_fsdp.rewards.math_answer:score_boxed_exact",
}
DEFAULT_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclass
class MathConfig(TaskConfig):
    # data: files or saved-dataset folders; each evaluation file is one set, named by its file name
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    # field layout: a preset (gsm8k, math, orz, messages), any field overridden by name
    preset: str = "orz"  # a name in data/fields.py PRESETS
    question_field: str = ""
    answer_field: str = ""
    answer_format: str = ""  # "" (the preset's) or one of data/fields.py ANSWER_FORMATS
    solution_field: str = ""
    # the user turn: the question inside this template ({question}; literal braces doubled)
    prompt_template: str = DEFAULT_TEMPLATE
    # prompts longer than this many tokens (chat template included) are skipped and counted; 0: no limit
    max_prompt_tokens: int = 0
    # a record without a usable question or gold answer: "error" stops before training, "skip" skips and counts
    on_bad_record: Literal["error", "skip"] = "error"
    # "math_verify", "exact_match" (last boxed answer == gold as strings), or your own
    # "package.module:function(completion, gold) -> reward | (reward, outcome)"
    reward: str = "math_verify"
    reward_workers: int = 2
    # an answer whose checking takes longer gets the outcome "timeout" (its worker is replaced)
    reward_timeout_s: float = 10.0
    max_new_tokens: int = 1024
    # evaluation problems used (from the start of the eval files); 0: all of them
    eval_size: int = 0

    def check(self) -> list[tuple[str, str]]:
        bad = [(k, w) for k, w in super().check() if k != "eval_size"]
        checks = [
            ("train_files", bool(self.train_files), "a non-empty list of data files (the training problems)"),
            ("eval_size", self.eval_size >= 0, ">= 0"),
            ("max_prompt_tokens", self.max_prompt_tokens >= 0, ">= 0"),
            ("reward_workers", self.reward_workers >= 1, ">= 1"),
            ("reward_timeout_s", self.reward_timeout_s > 0, "> 0"),
            ("prompt_template", "{question}" in self.prompt_template, "a template containing {question}"),
            ("preset", self.preset in PRESETS, f"one of {', '.join(map(repr, sorted(PRESETS)))}"),
            ("answer_format", self.answer_format in ("", *ANSWER_FORMATS), f"'' or one of {ANSWER_FORMATS}"),
        ]
        return bad + [(key, what) for key, ok, what in checks if not ok]


@register_task("math")
class MathTask(Task):
    config_class = MathConfig
    cfg: MathConfig

    def __init__(self, cfg: MathConfig) -> None:
        super().__init__(cfg)
        self.spec = field_spec(cfg.preset, cfg.question_field, cfg.answer_field, cfg.answer_format, cfg.solution_field)
        self.skipped: Counter[str] = Counter()  # reason -> records skipped (on_bad_record = "skip")
        self.train = self._load(cfg.train_files, "task.train_files")
        self._eval_sets = {Path(f).stem: self._load([f], "task.eval_files") for f in cfg.eval_files}
        evals = [p for probs in self._eval_sets.values() for p in probs]
        self._eval = evals[: cfg.eval_size] if cfg.eval_size else evals
        # a warm start from scratch builds a character tokenizer over every character the problems use
        self.alphabet = "".join(sorted({c for p in self.train + evals for c in p.prompt + p.solution}))
        self._orders: dict[tuple[int, int], list[int]] = {}

    def _load(self, files: list[str], key: str) -> list[Problem]:
        return read_problems(self.cfg, self.spec, files, key, self.skipped, check_gold=self.cfg.reward == "math_verify")

    @classmethod
    def check_files(cls, cfg: TaskConfig) -> None:
        """Every data file exists, parses and has usable records (the fields the preset or the keys name), checked
        without math-verify's parse of each gold answer (the slow part of loading, left to the task's start)."""
        assert isinstance(cfg, MathConfig)
        spec = field_spec(cfg.preset, cfg.question_field, cfg.answer_field, cfg.answer_format, cfg.solution_field)
        read_problems(cfg, spec, cfg.train_files, "task.train_files", Counter(), check_gold=False)
        for f in cfg.eval_files:
            read_problems(cfg, spec, [f], "task.eval_files", Counter(), check_gold=False)

    @property
    def reward_path(self) -> str:
        """`package.module:function` of the reward (a built-in name resolved)."""
        return BUILTIN_REWARDS.get(self.cfg.reward, self.cfg.reward)

    def train_problem(self, seed: int, index: int) -> Problem:
        epoch, pos = divmod(index, len(self.train))
        order = self._orders.get((seed, epoch))
        if order is None:
            order = list(range(len(self.train)))
            random.Random(f"math:{seed}:{epoch}").shuffle(order)
            self._orders = {(seed, epoch): order}  # one epoch at a time: streams move forward
        return self.train[order[pos]]

    def epoch(self, index: int) -> int | None:
        """The epoch that stream position `index` belongs to."""
        return index // len(self.train)

    def eval_split(self) -> list[Problem]:
        return self._eval

    def eval_sets(self) -> dict[str, list[Problem]]:
        """One set per evaluation file (the first task.eval_size problems of each when set)."""
        n = self.cfg.eval_size
        return {name: probs[:n] if n else probs for name, probs in self._eval_sets.items()}

    def reward(self, completion: str, answer: str) -> float:
        from pipelinerl_fsdp.rewards.pool import load_reward_function

        out = load_reward_function(self.reward_path)(completion, answer)
        return float(out[0] if isinstance(out, tuple) else out)

    def scorer(self) -> Scorer:
        try:
            pool = RewardPool(self.reward_path, self.cfg.reward_workers, self.cfg.reward_timeout_s)
        except ValueError as e:
            raise ConfigError(f"task.reward: {e}") from None
        return PoolScorer(pool)

    def longest_prompt(self) -> str:
        return max((p.prompt for p in self.train + self._eval), key=len)

    def prompts_to_check(self) -> list[str]:
        return [p.prompt for p in self.train + self._eval]


def read_problems(
    cfg: MathConfig, spec: FieldSpec, files: list[str], key: str, skipped: Counter[str], *, check_gold: bool
) -> list[Problem]:
    """The problems of `files` (config key `key`), a bad record an error naming it or counted into `skipped`
    (`task.on_bad_record`); `check_gold`: a gold answer math-verify cannot parse is a bad record."""
    out: list[Problem] = []
    for f in files:
        try:
            records = read_records(f)
        except DataError as e:
            raise ConfigError(f"{key}: {e}") from None
        for r in records:
            got = problem_fields(r, spec)
            if isinstance(got, tuple) and check_gold and not _gold_parses(got[1]):
                got = f"gold answer {got[1]!r} cannot be parsed by math-verify"
            if isinstance(got, str):
                if cfg.on_bad_record == "error":
                    raise ConfigError(
                        f"{r.where}: {got} (preset {cfg.preset!r}; set task.on_bad_record = 'skip' to skip such "
                        "records)"
                    )
                skipped[got] += 1
                continue
            question, gold, solution = got
            out.append(Problem(cfg.prompt_template.format(question=question), gold, solution))
    if not out:
        raise ConfigError(f"{key}: no usable problems in {', '.join(files)}")
    return out


def _gold_parses(gold: str) -> bool:
    from pipelinerl_fsdp.rewards.math_answer import parse_gold

    return bool(parse_gold(gold))
