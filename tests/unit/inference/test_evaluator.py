"""Evaluation on an engine: every problem of the engine's share asked `eval.samples` times, scored by the task's
scorer, counted into the right row of its set's report; request ids never collide with rollouts."""

from __future__ import annotations

import pytest

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference.evaluator import EVAL_RID_BASE, EngineEvaluator, evaluate_alone
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rewards.scorer import InlineScorer
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer


@pytest.mark.parametrize("engine_index, n_engines", [(0, 1), (1, 2)])
def test_reports_count_correct_samples_per_problem(engine_index: int, n_engines: int):
    samples = 3
    cfg = load_config(["--config", "arithmetic", f"--eval.samples={samples}", "--eval.every=1", "--task.eval_size=7"])
    task = make_task(cfg.task)
    tok = build_char_tokenizer(ALPHABET)
    problems = next(iter(task.eval_sets().values()))
    rewarded = {p.answer for p in problems[:3]}  # a reward that only the first three problems' golds earn
    asked: list[str] = []

    def reward(completion: str, gold: str) -> float:
        asked.append(gold)
        return float(gold in rewarded)

    evaluator = EngineEvaluator(
        cfg.eval,
        cfg.tokenizer,
        task,
        tok,
        engine_index,
        n_engines,
        final_version=cfg.rl.max_steps,
        max_new_tokens=cfg.task.max_new_tokens,
    )
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    engine = ReferenceEngine(build_model(args, seed=0), 4, 64, eos_ids=[tok.eos_token_id], temperature=1.0)
    [report] = evaluate_alone(evaluator, engine, InlineScorer(reward), tok, [tok.eos_token_id], 5, 4)
    share = list(range(engine_index, len(problems), n_engines))
    assert report.version == 5 and report.problems == share and report.samples == samples
    assert report.correct == [samples * (problems[i].answer in rewarded) for i in share]
    assert sorted(asked) == sorted(problems[i].answer for i in share for _ in range(samples))
    assert not evaluator.busy()
    assert not evaluator.due(5)  # one evaluation per version


def test_evaluation_ids_are_above_rollout_ids():
    cfg = load_config(["--config", "arithmetic", "--eval.every=1", "--task.eval_size=4"])
    task = make_task(cfg.task)
    evaluator = EngineEvaluator(
        cfg.eval,
        cfg.tokenizer,
        task,
        build_char_tokenizer(ALPHABET),
        0,
        1,
        final_version=cfg.rl.max_steps,
        max_new_tokens=cfg.task.max_new_tokens,
    )
    evaluator.start(1)
    rids = [r.request_id for r in evaluator.queue]
    assert len(rids) == 4 and min(rids) >= EVAL_RID_BASE and all(evaluator.owns(r) for r in rids)
    assert not evaluator.owns(EVAL_RID_BASE - 1)
