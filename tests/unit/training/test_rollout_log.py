"""Rollout records: versions as ranges, gold looked up from the problem's stream position, decoded text."""

from __future__ import annotations

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer
from pipelinerl_fsdp.training.rollout_log import RolloutLog, as_text, version_ranges


def test_version_ranges():
    assert version_ranges([3, 3, 4, 4, 4, 5]) == [[0, 1, 3], [2, 4, 4], [5, 5, 5]]
    assert version_ranges([7]) == [[0, 0, 7]] and version_ranges([]) == []


def test_records_carry_the_problem_and_the_outcome(tmp_path):
    task = make_task(load_config([]).task)
    tok = build_char_tokenizer(ALPHABET)
    problem = task.train_problem(0, 12)
    ids = tok(problem.prompt, add_special_tokens=False)["input_ids"]
    comp = tok(problem.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    s = Sample(12, ids, comp, [-0.1] * len(comp), [4, 4, 5, 5][: len(comp)] + [5] * (len(comp) - 4), 1.0, 0.5, True, 0)
    log = RolloutLog(tmp_path, tok, task, seed=0, every=3)
    (rec,) = log.records([s], trained_version=6)
    assert rec["prompt"] == problem.prompt and rec["gold"] == problem.answer and rec["outcome"] == "correct"
    assert rec["completion"].startswith(problem.answer) and rec["versions"][0] == [0, 1, 4] and rec["lag_max"] == 2
    assert rec["token_ids"] == comp and rec["logprobs"] == [-0.1] * len(comp)  # what a reader rescores
    assert log.due(3) and not log.due(4)
    path = log.write(3, [rec])
    assert path.name == "step-0000003.jsonl" and problem.answer in as_text(rec)
