"""Length distributions: their draws against their closed-form means and bounds, determinism for a seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelinerl_fsdp.perf.lengths import Empirical, PowerLaw, Uniform


def test_power_law_matches_its_definition():
    law = PowerLaw(alpha=1.5, lo=10, hi=1000)
    x = law.sample(np.random.default_rng(0), 200_000)
    assert x.min() >= 10 and x.max() <= 1000
    ls = np.arange(10, 1001)
    w = ls**-1.5
    assert x.mean() == pytest.approx((ls * w).sum() / w.sum(), rel=0.02)  # the mean of L^-1.5 on 10..1000
    # P(L = 10) / P(L = 20) = 2^1.5
    assert np.mean(x == 10) / np.mean(x == 20) == pytest.approx(2**1.5, rel=0.1)


def test_uniform_and_fixed():
    x = Uniform(100, 300).sample(np.random.default_rng(1), 100_000)
    assert x.min() == 100 and x.max() == 300 and x.mean() == pytest.approx(200, rel=0.01)
    assert set(Uniform(7, 7).sample(np.random.default_rng(1), 10)) == {7}


def test_same_seed_same_draws():
    for dist in (PowerLaw(1.2, 1, 8192), Uniform(1, 50), Empirical((3, 9, 27))):
        a = dist.sample(np.random.default_rng(5), 1000)
        b = dist.sample(np.random.default_rng(5), 1000)
        assert np.array_equal(a, b) and not np.array_equal(a, dist.sample(np.random.default_rng(6), 1000))


def test_empirical_from_a_rollout_dump(tmp_path):
    (tmp_path / "step-0000010.jsonl").write_text("".join(json.dumps({"tokens": n}) + "\n" for n in (5, 50)))
    (tmp_path / "step-0000020.jsonl").write_text(json.dumps({"tokens": 500}) + "\n")
    e = Empirical.from_rollouts(tmp_path)
    assert sorted(e.values) == [5, 50, 500] and e.mean() == 185
    assert set(e.sample(np.random.default_rng(0), 100)) == {5, 50, 500}
    (tmp_path / "bad.jsonl").write_text('{"completion": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        Empirical.from_rollouts(tmp_path / "bad.jsonl")


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="lo = 0"):
        PowerLaw(1.0, 0, 10)
    with pytest.raises(ValueError, match="Empirical"):
        Empirical(())
