"""Rewards: math-verify on tricky answers, and the reward pool's deadlines, crashes and recovery."""

from __future__ import annotations

import time

import pytest

from pipelinerl_fsdp.rewards.math_answer import last_boxed, score_boxed_exact, score_math_answer
from pipelinerl_fsdp.rewards.outcomes import OUTCOMES, outcome_for
from pipelinerl_fsdp.rewards.pool import RewardPool, load_reward_function
from pipelinerl_fsdp.rewards.scorer import InlineScorer, PoolScorer

# (completion, gold, expected outcome)
TRICKY = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", "correct"),  # \frac vs /
    ("\\boxed{0.5}", "\\frac{1}{2}", "correct"),  # decimal vs fraction
    ("\\boxed{\\dfrac{3}{4}}", "3/4", "correct"),  # LaTeX variant
    ("\\boxed{50\\%}", "0.5", "correct"),  # percentage
    ("\\boxed{[1, 2)}", "[1,2)", "correct"),  # interval
    ("\\boxed{(1, 2)}", "[1,2)", "wrong"),  # open vs half-open
    ("\\boxed{5 \\text{ cm}}", "5", "correct"),  # units
    ("\\boxed{1,000}", "1000", "correct"),  # thousands separator
    ("\\boxed{x^2+11x+28}", "x^2 + 11x + 28", "correct"),  # expression
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", "correct"),
    ("\\boxed{x=3}", "3", "correct"),  # an equation's right-hand side
    ("\\boxed{4}", "3", "wrong"),
    ("the answer is 7", "7", "no_answer"),  # no box
    ("\\boxed{3", "3", "no_answer"),  # a box cut off
    ("\\boxed{3} or rather \\boxed{4}", "4", "correct"),  # two boxes: the last one counts
    ("\\boxed{3} or rather \\boxed{4}", "3", "wrong"),
    ("\\boxed{}", "3", "unparsable"),  # an empty box
]


@pytest.mark.parametrize("completion, gold, outcome", TRICKY)
def test_math_answers(completion, gold, outcome):
    reward, got = score_math_answer(completion, gold)
    assert got == outcome and reward == (1.0 if outcome == "correct" else 0.0)


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}} x \\boxed{{1}+{2}}") == "{1}+{2}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("none") is None


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("so \\boxed{ 42 }", "42", (1.0, "correct")),
        ("\\boxed{1/2}", "\\frac{1}{2}", (0.0, "wrong")),  # no parsing: equal values, different strings
        ("\\boxed{7} then \\boxed{8}", "8", (1.0, "correct")),  # the last box counts
        ("the answer is 42", "42", (0.0, "no_answer")),
    ],
)
def test_exact_match_reward_compares_strings(completion, gold, expected):
    assert score_boxed_exact(completion, gold) == expected


def test_outcome_for_exact_rewards():
    assert outcome_for(1.0, True) == "correct" and outcome_for(0.0, True) == "wrong"
    assert outcome_for(1.0, False) == "truncated"
    assert OUTCOMES.index("correct") == 0  # the code 0 is what samples default to


def test_pool_scores_math_and_survives_a_hostile_answer():
    pool = RewardPool("pipelinerl_fsdp.rewards.math_answer:score_math_answer", workers=2, timeout_s=1.5)
    try:
        pool.submit("tower", "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}", "1")  # math-verify needs ~3 s on this one
        for i, (c, g, _) in enumerate(TRICKY[:6]):
            pool.submit(i, c, g)
        got = {k: (r, o) for k, r, o in pool.wait_all(timeout_s=60)}
        assert got["tower"] == (0.0, "timeout") and pool.timeouts == 1
        assert [got[i][1] for i in range(6)] == [o for _, _, o in TRICKY[:6]]
        # the replaced worker takes answers again
        pool.submit("after", "\\boxed{2}", "2")
        assert pool.wait_all(timeout_s=30) == [("after", 1.0, "correct")]
    finally:
        pool.close()


def test_pool_hang_crash_and_exception_cost_one_answer_each():
    pool = RewardPool("reward_helpers:misbehave", workers=2, timeout_s=1.0)
    try:
        for key, completion in [
            ("hang", "HANG"),
            ("crash", "CRASH"),
            ("raise", "RAISE"),
            ("tuple", "TUPLE"),
            ("ok", "5"),
            ("no", "6"),
        ]:
            pool.submit(key, completion, "5")
        t0 = time.monotonic()
        got = {k: (r, o) for k, r, o in pool.wait_all(timeout_s=60)}
        assert got == {
            "hang": (0.0, "timeout"),
            "crash": (0.0, "error"),
            "raise": (0.0, "error"),
            "tuple": (0.5, "no_answer"),
            "ok": (1.0, "correct"),
            "no": (0.0, "wrong"),
        }
        assert pool.timeouts == 1 and pool.crashes == 1
        assert time.monotonic() - t0 < 30
    finally:
        pool.close()


def test_bad_reward_function_paths_are_named():
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        load_reward_function("no_colon")
    with pytest.raises(ValueError, match="'nosuch.mod:f' cannot be loaded"):
        load_reward_function("nosuch.mod:f")
    with pytest.raises(ValueError, match="is not callable"):
        load_reward_function("reward_helpers:NOT_CALLABLE")


def test_scorers_report_truncation():
    inline = InlineScorer(lambda c, g: float(c == g))
    inline.submit(1, "3", "3", finished=True)
    inline.submit(2, "3", "3", finished=False)
    assert inline.ready() == [(1, 1.0, "correct"), (2, 1.0, "truncated")] and inline.ready() == []
    scorer = PoolScorer(RewardPool("reward_helpers:misbehave", workers=1, timeout_s=10))
    try:
        scorer.submit("a", "5", "5", finished=False)
        deadline = time.monotonic() + 30
        out = []
        while not out and time.monotonic() < deadline:
            out = scorer.ready()
            time.sleep(0.01)
        assert out == [("a", 1.0, "truncated")]
    finally:
        scorer.close()
