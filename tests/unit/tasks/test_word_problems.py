"""Word problems for a small chat model: answers recomputed from each question's text, the last-integer reward,
graded levels, a fixed held-out split disjoint from training, config errors by key."""

import random
import re

import pytest

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.word_problems import WordProblemsConfig, last_integer

# each template's reading, independent of the generator: (pattern over the question, the answer from its numbers)
READINGS = [
    (r"has (\d+) \w+\. \w+ gets (\d+) more", lambda a, b: a + b),
    (r"has (\d+) \w+ and gives (\d+) to", lambda a, b: a - b),
    (r"^\w+ buys (\d+) \w+ with (\d+) \w+ in each", lambda a, b: a * b),
    (r"shares (\d+) \w+ equally among (\d+) friends", lambda n, k: n // k if n % k == 0 else None),
    (r"has (\d+) \w+\. \w+ buys (\d+) \w+ with (\d+) \w+ in each", lambda c, a, b: c + a * b),
    (r"has (\d+) \w+, finds (\d+) more, then gives (\d+) away", lambda a, b, c: a + b - c),
]


def read_answer(question: str) -> int:
    found = [(f, m) for pattern, f in READINGS if (m := re.search(pattern, question))]
    assert len(found) == 1, question
    f, m = found[0]
    return f(*map(int, m.groups()))


@pytest.mark.parametrize("levels", [[1], [2], [3], [1, 2, 3]])
def test_answers_follow_from_the_question(levels):
    task = make_task(WordProblemsConfig(name="word_problems", levels=levels))
    rng = random.Random(0)
    longest = len(task.longest_prompt())
    for _ in range(400):
        p = task.sample(rng)
        question, instruction = p.prompt.split("\n")
        assert instruction == task.cfg.instruction
        assert int(p.answer) == read_answer(question) and int(p.answer) >= 0
        assert task.reward(p.solution, p.answer) == 1.0
        assert len(p.prompt) <= longest


def test_levels_draw_their_own_templates():
    rng = random.Random(1)
    one = make_task(WordProblemsConfig(name="word_problems", levels=[1]))
    three = make_task(WordProblemsConfig(name="word_problems", levels=[3]))
    assert not any(" in each" in one.sample(rng).prompt or "shares" in one.sample(rng).prompt for _ in range(200))
    assert all("then gives" in q or "in each" in q for q in (three.sample(rng).prompt for _ in range(200)))


def test_reward_is_the_last_integer():
    task = make_task(WordProblemsConfig(name="word_problems"))
    assert task.reward("7 + 5 = 12. The answer is 12.", "12") == 1.0
    assert task.reward("The answer is 12. Or maybe 13", "12") == 0.0
    assert task.reward("1,200 + 34 = 1,234", "1234") == 1.0
    assert task.reward("no number here", "3") == 0.0
    assert last_integer("-4 left") == -4 and last_integer("") is None


def test_heldout_split_fixed_distinct_and_never_trained_on():
    cfg = WordProblemsConfig(name="word_problems", eval_size=300)
    task, again = make_task(cfg), make_task(cfg)
    split = task.eval_split()
    assert [p.prompt for p in split] == [p.prompt for p in again.eval_split()]
    assert len({p.prompt for p in split}) == 300
    held = {p.prompt for p in split}
    assert not any(task.train_problem(0, i).prompt in held for i in range(2000))


@pytest.mark.parametrize(
    "override, key",
    [
        ("--task.levels=[4]", "task.levels"),
        ("--task.levels=[]", "task.levels"),
        ("--task.max_number=2", "task.max_number"),
    ],
)
def test_bad_keys_are_named(tmp_path, override, key):
    from pipelinerl_fsdp.configure import load_config

    toml = tmp_path / "wp.toml"
    toml.write_text('[model]\nflavour = "debug"\n[task]\nname = "word_problems"\n')
    load_config(["--config", str(toml)])  # the defaults are fine
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(["--config", str(toml), override])
