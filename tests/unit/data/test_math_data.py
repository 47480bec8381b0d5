"""Math problems from files: every format and preset, bad input named with file and line, epochs and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.data.fields import field_spec, gold_from, problem_fields
from pipelinerl_fsdp.data.files import DataError, Record, read_records
from pipelinerl_fsdp.tasks import ProblemStream, make_task

DATA = Path(__file__).resolve().parents[3] / "data" / "math"


def math_task(tmp_path: Path, *args: str):
    return make_task(load_config(["--task.name=math", *args]).task)


@pytest.mark.parametrize(
    "file, preset, n",
    [
        ("gsm8k_train.jsonl", "gsm8k", 320),
        ("math_train.jsonl", "math", 80),
        ("orz.parquet", "orz", 100),
        ("orz_saved", "orz", 60),
        ("messages.jsonl", "messages", 40),
    ],
)
def test_every_format_and_preset_loads(tmp_path, file, preset, n):
    task = math_task(tmp_path, f"--task.train_files=['{DATA / file}']", f"--task.preset={preset}")
    assert len(task.train) == n
    p = task.train_problem(0, 0)
    assert "\\boxed{}" in p.prompt and p.answer and "\\boxed{" in p.solution
    assert task.reward(p.solution, p.answer) == 1.0  # the reference solution scores as correct


def test_gold_answers_per_format():
    assert gold_from("3 + 4 = 7\n#### 1,234", "gsm8k") == "1234"
    assert gold_from("so $\\boxed{\\frac{7}{3}}$.", "boxed") == "\\frac{7}{3}"
    assert gold_from(" 42 ", "plain") == "42" and gold_from("no marker", "gsm8k") is None
    rec = Record({"question": "q?", "answer": "work\n#### 12"}, "f:1")
    assert problem_fields(rec, field_spec("gsm8k")) == ("q?", "12", "work\nThe answer is \\boxed{12}.")


def test_field_overrides(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "gold": "4"}) + "\n")
    task = math_task(
        tmp_path, f"--task.train_files=['{path}']", "--task.question_field=prompt", "--task.answer_field=gold"
    )
    assert task.train[0].answer == "4" and task.train[0].prompt.startswith("2+2?")


@pytest.mark.parametrize(
    "content, pattern",
    [
        ('{"problem": "a", "answer": "1"}\n{"problem": "b", \n', r"bad\.jsonl:2: invalid JSON"),
        ('{"problem": "a"}\n', r"bad\.jsonl:1: missing field 'answer'"),
        ('{"problem": "a", "answer": ""}\n', r"bad\.jsonl:1: field 'answer' holds no plain answer"),
        (
            '{"problem": "a", "answer": "\\\\frac{1}{2}"}\n{"problem": "b", "answer": "\\\\frac{"}\n',
            r"bad\.jsonl:2: gold answer '\\\\frac\{' cannot be parsed by math-verify",
        ),
        ("\n\n", r"bad\.jsonl: no records"),
        ("[1, 2]\n", r"bad\.jsonl:1: expected an object with fields"),
    ],
)
def test_bad_records_are_named_with_file_and_line(tmp_path, content, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=pattern):
        math_task(tmp_path, f"--task.train_files=['{path}']")


def test_skip_and_count_bad_records(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b"}\n{"problem": "c", "answer": "3"}\n')
    task = math_task(tmp_path, f"--task.train_files=['{path}']", "--task.on_bad_record=skip")
    assert [p.answer for p in task.train] == ["1", "3"] and task.skipped == {"missing field 'answer'": 1}


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.train_files: .*nope\.jsonl: no such file"):
        math_task(tmp_path, f"--task.train_files=['{tmp_path / 'nope.jsonl'}']")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"unknown data file kind '\.csv'"):
        math_task(tmp_path, f"--task.train_files=['{tmp_path / 'x.csv'}']")
    with pytest.raises(ConfigError, match=r"task\.train_files = \[\] must be a non-empty list"):
        load_config(["--task.name=math"])
    with pytest.raises(DataError, match="without state.json"):
        read_records(tmp_path)


def test_epochs_reshuffle_and_streams_resume_and_stay_disjoint(tmp_path):
    task = math_task(tmp_path, f"--task.train_files=['{DATA / 'math_train.jsonl'}']", "--task.preset=math")
    n = len(task.train)
    first = [task.train_problem(7, i).prompt for i in range(n)]
    second = [task.train_problem(7, n + i).prompt for i in range(n)]
    assert sorted(first) == sorted(p.prompt for p in task.train)  # an epoch visits every problem once
    assert first != second and sorted(first) == sorted(second)  # ...in a fresh order each epoch
    assert task.epoch(n - 1) == 0 and task.epoch(n) == 1
    a, b = ProblemStream(task, 7, offset=0, stride=2), ProblemStream(task, 7, offset=1, stride=2)
    taken = [next(a).prompt for _ in range(n // 2)] + [next(b).prompt for _ in range(n // 2)]
    assert sorted(taken) == sorted(first)  # two engines' shares: disjoint, together one epoch
    state = a.state_dict()
    nxt = [next(a) for _ in range(5)]
    again = ProblemStream(task, 7, offset=0, stride=2)
    again.reset(state)
    assert [next(again) for _ in range(5)] == nxt


def test_eval_sets_are_named_by_file(tmp_path):
    task = math_task(
        tmp_path,
        f"--task.train_files=['{DATA / 'gsm8k_train.jsonl'}']",
        "--task.preset=gsm8k",
        f"--task.eval_files=['{DATA / 'gsm8k_test.jsonl'}']",
        "--task.eval_size=10",
    )
    assert list(task.eval_sets()) == ["gsm8k_test"] and len(task.eval_sets()["gsm8k_test"]) == 10
    assert len(task.eval_split()) == 10


def test_presets_and_answer_formats_are_checked_against_their_registry():
    with pytest.raises(ConfigError, match=r"task\.preset = 'nope' must be one of 'gsm8k', 'math', 'messages', 'orz'"):
        load_config(["--config", "math_tiny_cpu", "--task.preset=nope"])
    with pytest.raises(ConfigError, match=r"task\.answer_format = 'latex' must be '' or one of"):
        load_config(["--config", "math_tiny_cpu", "--task.answer_format=latex"])
