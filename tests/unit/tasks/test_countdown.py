"""The long-generation task: exact worked solutions, the tail's and the uniform twin's length distributions (against
the formula), disjoint held-out sets at every length, and the keys' checks."""

import random
import statistics

import pytest

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.countdown import ALPHABET, CountdownConfig, tail_mean, tail_weights, uniform_band


def lengths(task, n: int = 20000, seed: int = 0) -> list[int]:
    """Completion tokens (one per character, EOS included) of n sampled problems."""
    rng = random.Random(seed)
    return [len(task.sample(rng).solution) + 1 for _ in range(n)]


def test_solution_is_the_worked_countdown_and_the_reward_exact():
    task = make_task(CountdownConfig(name="countdown"))
    rng = random.Random(3)
    for _ in range(200):
        p = task.sample(rng)
        start, rest = p.prompt.rstrip("=").split("-")
        step, count = map(int, rest.split(":"))
        lines = [x.split(":") for x in p.solution.split("\n")]
        assert len(lines) == count and all(len(v) == 4 and len(c) == 3 for v, c in lines)
        assert [(int(v), int(c)) for v, c in lines] == [(int(start) - i * step, count - i) for i in range(1, count + 1)]
        assert set(p.prompt + p.solution) <= set(ALPHABET) and len(p.solution) + 1 == 9 * count
        assert task.reward(p.solution, p.answer) == 1.0 and task.reward(p.solution + "\n", p.answer) == 1.0
        wrong = p.solution[:-1] + str((int(p.solution[-1]) + 1) % 10)
        assert task.reward(wrong, p.answer) == 0.0 and task.reward(p.solution[:-5], p.answer) == 0.0


def test_tail_lengths_follow_the_power_law():
    cfg = CountdownConfig(name="countdown")
    ls = lengths(make_task(cfg))
    assert min(ls) == 9 * cfg.min_lines and max(ls) == 9 * cfg.max_lines >= 1024
    # P(L) ~ L^-1.5 on 3..114 (computed independently of the sampler): median and mean
    weights = {n: n**-1.5 for n in range(3, 115)}
    total, acc = sum(weights.values()), 0.0
    median_lines = next(n for n, w in weights.items() if (acc := acc + w) >= total / 2)
    mean_lines = sum(n * w for n, w in weights.items()) / total
    assert statistics.median(ls) == pytest.approx(9 * median_lines, abs=9)
    assert statistics.fmean(ls) == pytest.approx(9 * mean_lines, rel=0.03)
    assert max(ls) >= 8 * statistics.median(ls)  # the heavy tail the issue asks for
    assert tail_mean(3, 114, 1.5) == pytest.approx(mean_lines)
    assert len(tail_weights(3, 114, 1.5)) == 112


def test_uniform_twin_has_the_same_mean_and_nearly_equal_lengths():
    tail = lengths(make_task(CountdownConfig(name="countdown")))
    cfg = CountdownConfig(name="countdown", lengths="uniform")
    lo, hi = uniform_band(3, 114, 1.5, 0.1)
    assert cfg.line_range() == (lo, hi) and (lo, hi) == (15, 19)
    twin = lengths(make_task(cfg))
    assert statistics.fmean(twin) == pytest.approx(statistics.fmean(tail), rel=0.03)
    assert 9 * lo == min(twin) and max(twin) == 9 * hi and max(twin) <= 1.3 * min(twin)


@pytest.mark.parametrize("mode", ["tail", "uniform"])
def test_held_out_set_is_disjoint_from_training_at_every_length(mode):
    task = make_task(CountdownConfig(name="countdown", lengths=mode, eval_size=512))
    held = {p.prompt for p in task.eval_split()}
    assert len(held) == 512
    train = [task.train_problem(0, i) for i in range(2000)]
    assert not {p.prompt for p in train} & held


@pytest.mark.parametrize(
    "override, message",
    [
        ("--task.lengths=long", r"task\.lengths = 'long' must be 'tail' or 'uniform'"),
        ("--task.max_lines=2", r"task\.max_lines = 2 must be >= task\.min_lines = 3"),
        ("--task.max_step=10", r"task\.max_step = 10 must be between 1 and 9"),
        ("--task.max_lines=2000", r"task\.max_lines = 2000 must be <= 999"),
        ("--task.max_new_tokens=1000", r"task\.max_new_tokens = 1000 must be >= 1026"),
    ],
)
def test_bad_keys_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "long_tail", override])
