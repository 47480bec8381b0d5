"""Held-out evaluation on an inference engine, next to the rollouts.

When the engine loads a policy version that is due (`eval.every`, the final version, version 0 with
`eval.at_start`), this engine's share of every evaluation set (every n-th problem) is queued as requests with the
evaluation sampling settings, `eval.samples` per problem. They share the engine's slots with the rollouts, are
scored by the task's scorer like rollouts, and never become training samples: once all of a set's requests are
scored, one `EvalReport` (correct completions per problem) goes to the trainer, which joins the engines' reports.
The report carries the version loaded when the evaluation started; in pipeline mode a later update may still
reach a long completion's last tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import EvalConfig, TokenizerConfig
from pipelinerl_fsdp.inference.engine import Engine, Request
from pipelinerl_fsdp.inference.turns import scored_text
from pipelinerl_fsdp.rewards.scorer import Scorer
from pipelinerl_fsdp.samples import EvalReport
from pipelinerl_fsdp.tasks import Task
from pipelinerl_fsdp.tokenizer import encode_prompt

# evaluation request ids start here, far above any rollout id (stream position x attempts)
EVAL_RID_BASE = 1 << 50


@dataclass
class _Job:
    report: EvalReport
    left: int  # requests not scored yet
    row: dict[int, int] = field(default_factory=dict)  # problem index -> position in report.correct


class EngineEvaluator:
    def __init__(
        self,
        ev: EvalConfig,
        tok: TokenizerConfig,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        engine_index: int,
        n_engines: int,
        *,
        final_version: int,
        max_new_tokens: int,
        max_prompt_tokens: int = 0,
    ) -> None:
        """This engine's share (`engine_index` of `n_engines`) of every evaluation set of `task`; `final_version`
        (`rl.max_steps`) is always evaluated; completions get `max_new_tokens` (`task.max_new_tokens`)."""
        self.ev, self.task = ev, task
        self.final_version, self.max_new_tokens = final_version, max_new_tokens
        self.every, self.samples = ev.every, ev.samples
        # this engine's share of each set: (problem index, prompt ids, gold answer); too-long prompts left out
        self.shares: list[list[tuple[int, list[int], str]]] = []
        for problems in task.eval_sets().values():
            share = []
            for i in range(engine_index, len(problems), n_engines):
                ids = encode_prompt(tokenizer, problems[i].prompt, tok)
                if not max_prompt_tokens or len(ids) <= max_prompt_tokens:
                    share.append((i, ids, problems[i].answer))
            self.shares.append(share)
        self.queue: deque[Request] = deque()
        self._meta: dict[int, tuple[tuple[int, int], int, str]] = {}  # rid -> ((set, version), problem, gold)
        self._jobs: dict[tuple[int, int], _Job] = {}
        self._next_rid = EVAL_RID_BASE
        self._started: set[int] = set()

    def due(self, version: int) -> bool:
        if not self.every or not self.shares or version in self._started:
            return False
        final = version == self.final_version
        return final or (version % self.every == 0 and (version > 0 or self.ev.at_start))

    def start(self, version: int) -> list[EvalReport]:
        """Queue the requests of every set for `version`; returns the reports already complete (empty shares)."""
        self._started.add(version)
        ready = []
        ev = self.ev
        for s, share in enumerate(self.shares):
            key = (s, version)
            report = EvalReport(s, version, self.samples, [i for i, _, _ in share], [0] * len(share))
            if not share:
                ready.append(report)
                continue
            job = _Job(report, len(share) * self.samples, {i: row for row, (i, _, _) in enumerate(share)})
            self._jobs[key] = job
            for i, ids, gold in share:
                for _ in range(self.samples):
                    rid = self._next_rid
                    self._next_rid += 1
                    self._meta[rid] = (key, i, gold)
                    episode = self.task.start_episode(gold)  # None: single-turn
                    self.queue.append(
                        Request(
                            rid,
                            ids,
                            self.max_new_tokens,
                            temperature=ev.temperature,
                            top_p=ev.top_p,
                            episode=episode,
                        )
                    )
        return ready

    def owns(self, request_id: int) -> bool:
        return request_id >= EVAL_RID_BASE

    def gold(self, request_id: int) -> str:
        return self._meta[request_id][2]

    def record(self, request_id: int, reward: float) -> EvalReport | None:
        """A scored evaluation completion; returns its set's report once the set is complete."""
        key, problem, _ = self._meta.pop(request_id)
        job = self._jobs[key]
        job.report.correct[job.row[problem]] += int(reward >= 1.0)
        job.left -= 1
        if job.left:
            return None
        del self._jobs[key]
        return job.report

    def busy(self) -> bool:
        """Requests queued or not yet scored."""
        return bool(self.queue or self._jobs)


def evaluate_alone(
    evaluator: EngineEvaluator,
    engine: Engine,
    scorer: Scorer,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: list[int],
    version: int,
    max_in_flight: int,
) -> list[EvalReport]:
    """Evaluate every set on an engine that has nothing else to do, as the inference loop would (the same
    requests, slots and scorer), and return the reports: a standalone evaluation of a policy."""
    reports = evaluator.start(version)
    while evaluator.busy():
        while evaluator.queue and engine.num_unfinished() < max_in_flight:
            engine.add(evaluator.queue.popleft())
        if engine.num_unfinished():
            for r in engine.step():
                text = scored_text(tokenizer, r, stop_ids)
                scorer.submit(r.request_id, text, evaluator.gold(r.request_id), r.finished)
        else:
            time.sleep(0.002)  # everything generated, scores still coming
        for rid, reward, _ in scorer.ready():
            report = evaluator.record(rid, reward)
            if report is not None:
                reports.append(report)
    return reports
