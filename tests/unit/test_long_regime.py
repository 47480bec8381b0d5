"""`benchmarks/long_regime.py`: pipeline's speed-ups on the long-tail and the uniform preset and their ratio, from two
learning_speed.json's modes. Expected values are divided by hand."""

from __future__ import annotations

import pytest

from benchmarks import long_regime as lr


def mode(t: float | None, sps: float) -> dict:
    return {"time_to_target_s": t, "steps_per_s": sps}


TAIL = {
    "modes": {
        "pipeline": mode(100.0, 0.5),
        "conventional_G1": mode(200.0, 0.25),
        "conventional_G4": mode(160.0, 0.4),
        "async": mode(120.0, 0.45),
    },
    "bound": 1.9,
}
UNIFORM = {
    "modes": {
        "pipeline": mode(100.0, 0.5),
        "conventional_G1": mode(125.0, 0.4),
        "conventional_G4": mode(150.0, 0.5),
        "async": mode(None, 0.5),
        "colocated": mode(300.0, 0.2),  # only on one preset: no row
    },
    "bound": 1.5,
}


def test_the_ratio_of_pipeline_s_speedups_is_tail_over_uniform():
    rows = {r["vs"]: r for r in lr.compare(TAIL, UNIFORM)}
    assert list(rows) == ["conventional_G1", "conventional_G4", "async", "best conventional"]
    g1 = rows["conventional_G1"]
    assert (g1["tail"], g1["uniform"]) == (pytest.approx(2.0), pytest.approx(1.25))
    assert g1["ratio"] == pytest.approx(1.6) and g1["claim_holds"] is True
    assert g1["steps_per_s_tail"] == pytest.approx(2.0) and g1["steps_per_s_uniform"] == pytest.approx(1.25)
    # the best conventional G differs: G4 on the tail (160 s), G1 on the uniform preset (125 s)
    best = rows["best conventional"]
    assert best["which"] == "conventional_G4 / conventional_G1"
    assert best["tail"] == pytest.approx(1.6) and best["uniform"] == pytest.approx(1.25)
    assert best["ratio"] == pytest.approx(1.28)
    # async never reached the target on the uniform preset: no time ratio, but the steps/s one
    a = rows["async"]
    assert a["uniform"] is None and a["ratio"] is None and a["claim_holds"] is None
    assert a["steps_per_s_ratio"] == pytest.approx((0.5 / 0.45) / 1.0)


def test_a_smaller_gain_on_the_tail_contradicts_the_claim():
    rows = {r["vs"]: r for r in lr.compare(UNIFORM, TAIL)}
    assert rows["conventional_G1"]["ratio"] == pytest.approx(0.625) and rows["conventional_G1"]["claim_holds"] is False


def test_pipeline_s_lag_and_the_bound_per_preset():
    saved = {"modes": {"pipeline": {"token_lag": {"p50": 1, "p90": 4, "max": 11, "hist": {}}}}, "bound": 1.8}
    assert lr.pipeline_lag(saved) == {"p50": 1, "p90": 4, "max": 11, "bound": 1.8}
    assert lr.pipeline_lag(TAIL)["p90"] is None  # no rollout dumps
