"""Arithmetic tasks: correct answers, exact rewards, a fixed eval split disjoint from training, resumable stream."""

import random

import pytest

from pipelinerl_fsdp.config import TaskConfig
from pipelinerl_fsdp.tasks import ProblemStream, make_task
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET, AdditionConfig, ChainSumConfig


def test_addition_problem_and_reward():
    task = make_task(AdditionConfig(digits=3))
    p = task.sample(random.Random(0))
    a, b = map(int, p.prompt.rstrip("=").split("+"))
    assert 100 <= a <= 999 and 100 <= b <= 999
    assert p.answer == str(a + b) == p.solution
    assert task.reward(p.answer, p.answer) == 1.0
    assert task.reward(p.answer + "1", p.answer) == 0.0
    assert task.reward("", p.answer) == 0.0


def test_chain_sum_steps_and_varied_lengths():
    task = make_task(ChainSumConfig(name="chain_sum", digits=2, min_terms=2, max_terms=8))
    rng = random.Random(1)
    problems = [task.sample(rng) for _ in range(300)]
    for p in problems:
        terms = list(map(int, p.prompt.rstrip("=").split("+")))
        assert 2 <= len(terms) <= 8
        assert p.answer == str(sum(terms))
        assert task.reward(p.solution, p.answer) == 1.0
        assert task.reward(p.solution.replace(f"A:{p.answer}", "A:0" if p.answer != "0" else "A:1"), p.answer) == 0.0
        assert set(p.prompt + p.solution) <= set(ALPHABET)
        assert len(p.solution.splitlines()) == len(terms)
    lengths = [len(p.solution) for p in problems]
    assert max(lengths) >= 4 * min(lengths)  # the long tail the pipeline mode exploits


def test_eval_split_fixed_and_disjoint_from_training():
    task = make_task(AdditionConfig(digits=1, eval_size=30, eval_seed=7))
    split = task.eval_split()
    assert [p.prompt for p in split] == [
        p.prompt for p in make_task(AdditionConfig(digits=1, eval_size=30, eval_seed=7)).eval_split()
    ]
    assert len({p.prompt for p in split}) == 30
    eval_prompts = {p.prompt for p in split}
    train = [task.train_problem(0, i).prompt for i in range(500)]
    assert not eval_prompts & set(train)


def test_stream_resumes_exactly_and_strides_disjoint():
    task = make_task(AdditionConfig(digits=3))
    s = ProblemStream(task, seed=3)
    for _ in range(5):
        next(s)
    state = s.state_dict()
    expected = [next(s) for _ in range(4)]
    s2 = ProblemStream(task, seed=3)
    s2.reset(state)
    assert [next(s2) for _ in range(4)] == expected
    a = ProblemStream(task, seed=3, offset=0, stride=2)
    b = ProblemStream(task, seed=3, offset=1, stride=2)
    whole = ProblemStream(task, seed=3)
    merged = [x for pair in zip([next(a) for _ in range(3)], [next(b) for _ in range(3)]) for x in pair]
    assert merged == [next(whole) for _ in range(6)]


def test_unknown_task():
    registered = "addition, chain_sum, countdown, guess_number, math, tool_arithmetic, word_problems"
    with pytest.raises(ValueError, match=f"unknown task 'poetry'; registered tasks: {registered}$"):
        make_task(TaskConfig(name="poetry"))


def test_a_restored_stream_continues_like_the_uninterrupted_one():
    task = make_task(AdditionConfig(digits=3))
    whole = ProblemStream(task, seed=5, offset=1, stride=3)  # one of three consumers
    for _ in range(4):
        next(whole)
    restored = ProblemStream(task, seed=5, offset=1, stride=3)
    restored.load_state_dict(whole.state_dict())
    assert restored.state_dict() == whole.state_dict() == {"index": 13}
    resumed = [next(restored) for _ in range(5)]
    assert resumed == [next(whole) for _ in range(5)]
    assert resumed[0] != next(ProblemStream(task, seed=5, offset=1, stride=3))  # not where a fresh stream starts
