"""The fair benchmark's pieces: mode specs with engines and bounds, the seeded order of the modes within a seed, the
paired per-seed ratios and their bootstrap interval (on cases worked by hand), the family bests behind each claim, and
the report regenerated from a summary file alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import learning_speed as ls
from benchmarks import learning_speed_claims as lc
from benchmarks import learning_speed_stats as st
from benchmarks.learning_speed_tasks import RunSpec, parse_mode


def test_mode_specs_name_their_g_bound_and_engine():
    assert parse_mode("pipeline") == RunSpec("pipeline", "pipeline", 1, None)
    assert parse_mode("conventional:4@reference") == RunSpec(
        "conventional_G4@reference", "conventional", 4, "reference"
    )
    assert parse_mode("async:2@vllm") == RunSpec("async_K2@vllm", "async", 2, "vllm")
    assert parse_mode("async") == RunSpec("async", "async", 1, None)
    for bad, why in [
        ("pipelin", "must be one of"),
        ("pipeline:2", "only conventional"),
        ("async:0", "integer >= 1"),
        ("conventional:4@gpu", "engine after @"),
        ("colocated@vllm", "reference engine only"),
    ]:
        with pytest.raises(SystemExit, match=why):
            parse_mode(bad)


def test_the_modes_of_a_seed_run_in_an_order_drawn_from_the_seed():
    specs = [parse_mode(x) for x in "pipeline,conventional:1,conventional:4,async,async:2,colocated".split(",")]
    orders = [[s.name for s in ls.mode_order(specs, seed, "random")] for seed in range(6)]
    assert all(sorted(o) == sorted(s.name for s in specs) for o in orders)  # a permutation each
    assert len({tuple(o) for o in orders}) > 3  # not one fixed order
    assert orders[2] == [s.name for s in ls.mode_order(specs, 2, "random")]  # the same for the same seed
    assert ls.mode_order(specs, 2, "fixed") == specs


def test_relative_targets_close_a_share_of_the_warm_start_s_remaining_error():
    # from 0.734 (one machine's old warm start) and 0.832 (another's): the same fractions, targets that differ
    assert ls.relative_targets(0.734, [0.35, 0.2, 0.5]) == [0.827, 0.787, 0.867]
    assert ls.relative_targets(0.832, [0.35]) == [0.891]
    with pytest.raises(SystemExit, match="fractions in"):
        ls.relative_targets(0.8, [1.5])  # not a share of the remaining error


def timed(t: float | None, wall: float = 100.0, sps: float = 1.0) -> dict:
    return {"time_to_target_s": t, "wall_s": wall, "steps_per_s": sps, "time_to_targets_s": {"0.8": t}}


def test_paired_ratio_of_equal_ratios_has_a_point_interval():
    r = st.paired_ratio([timed(20.0), timed(30.0), timed(10.0)], [timed(10.0), timed(15.0), timed(5.0)])
    assert r["per_seed"] == [2.0, 2.0, 2.0]
    assert r["geo_mean"] == pytest.approx(2.0) and r["ci95"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert r["excludes_1"] and r["censored"] == 0


def test_paired_ratio_interval_worked_by_hand():
    # two seeds, ratios 1 and 4: a resample is (1, 1) with probability 1/4 (geometric mean 1), (4, 4) with 1/4 (4),
    # mixed with 1/2 (2): the 2.5% and 97.5% percentiles are 1 and 4, the point estimate 2; the interval holds 1
    r = st.paired_ratio([timed(10.0), timed(40.0)], [timed(10.0), timed(10.0)])
    assert r["geo_mean"] == pytest.approx(2.0)
    assert r["ci95"] == [pytest.approx(1.0), pytest.approx(4.0)] and not r["excludes_1"]


def test_a_missed_target_counts_with_its_wall_time_and_is_marked():
    r = st.paired_ratio([timed(None, wall=90.0), timed(30.0)], [timed(30.0), timed(None, wall=60.0)])
    assert r["per_seed"] == [pytest.approx(3.0), pytest.approx(0.5)] and r["censored"] == 2


def aggregate(times: list[float], sps: float) -> dict:
    return {"seeds": [timed(t, sps=sps) for t in times], "time_to_target_s": sorted(times)[len(times) // 2]}


def test_claims_take_each_family_at_its_best_and_each_engine_alone():
    results = {
        "pipeline@vllm": aggregate([10.0, 12.0, 11.0], 2.0),
        "pipeline@reference": aggregate([14.0, 15.0, 16.0], 1.5),
        "conventional_G1@vllm": aggregate([40.0, 44.0, 42.0], 0.5),
        "conventional_G4@reference": aggregate([20.0, 24.0, 22.0], 1.0),
        "conventional_G1@reference": aggregate([30.0, 33.0, 36.0], 0.8),
        "colocated": aggregate([18.0, 18.0, 18.0], 1.0),
    }
    rows = {(c["view"], c["baseline"]): c for c in lc.claims(results, "vllm")}
    best = rows[("each mode at its best engine", "conventional_G4@reference")]
    assert best["pipeline"] == "pipeline@vllm"
    assert best["time"]["per_seed"] == [pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0)]
    assert best["steps_per_s_geo_mean"] == pytest.approx(2.0)
    assert rows[("vllm engine only", "conventional_G1@vllm")]["time"]["geo_mean"] == pytest.approx(
        math.exp((math.log(4.0) + math.log(44 / 12) + math.log(42 / 11)) / 3)
    )
    ref = rows[("reference engine only", "conventional_G4@reference")]
    assert ref["pipeline"] == "pipeline@reference"
    assert rows[("reference engine only", "colocated")]["time"]["per_seed"][0] == pytest.approx(18 / 14)
    assert ("vllm engine only", "colocated") not in rows  # colocated runs the reference engine only
    assert "| each mode at its best engine | pipeline@vllm | conventional_G4@reference | 2.00 [2.00, 2.00] | yes |" in (
        lc.claims_table(list(rows.values()), 3)
    )


def test_the_report_is_regenerated_from_the_summary_alone_bit_for_bit(tmp_path: Path):
    def step(i: int) -> dict:
        return {
            "step": i + 1, "wall_time_s": 2.0 * (i + 1), "samples": 64 * (i + 1), "reward_mean": 0.1 * i, "ess": 0.9,
            "lag_mean": 1.0, "lag_max": 2, "mixed_version_frac": 0.5, "trainer_busy_frac": 0.8,
            "inference_busy_frac": 0.7,
        }  # fmt: skip

    recs = [step(i) for i in range(6)]
    runs = {
        name: [
            st.summarise(
                recs,
                0.5,
                [0.6],
                2,
                {
                    "wall_time_s": [0, 5.0 * k, 10.0 * k],
                    "samples": [0, 64, 128],
                    "accuracy": [0.3, 0.55, 0.7],
                    "step": [0, 1, 2],
                },
            )
            for k in (1.0, 1.5)
        ]  # fmt: skip
        for name in ("pipeline@vllm", "conventional_G1@vllm")
    }
    meta = {"seeds": 2, "engine": "vllm", "target": 0.5, "window": 2, "metric_text": "held-out", "task": "t"}
    ls.write_summary(tmp_path / "s.json", runs, meta)
    ls.report_from_summary(tmp_path / "s.json", tmp_path / "a")
    ls.report_from_summary(tmp_path / "s.json", tmp_path / "b")
    for f in ("learning_speed.md", "learning_speed.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    md = (tmp_path / "a" / "learning_speed.md").read_text()
    assert "Paired per-seed ratios" in md and json.loads((tmp_path / "s.json").read_text())["settings"] == meta
