"""`benchmarks/learning_speed.py`'s statistics over seeds: medians that treat a missed target as slower than any
hit, the overlap bound from conventional G=1's busy fractions, and speed-ups taken between medians."""

from __future__ import annotations

import pytest

from benchmarks import heldout
from benchmarks import learning_speed as ls
from benchmarks import learning_speed_stats as st
from benchmarks import learning_speed_tasks as tasks


def run(time: float | None, ess: float = 1.0, busy: tuple[float, float] = (0.5, 0.5), sps: float = 1.0) -> dict:
    return {
        "time_to_target_s": time,
        "samples_to_target": None if time is None else 64 * time,
        "time_to_targets_s": {"0.5": time, "0.8": None},
        "final_reward": 0.9,
        "trainer_busy_frac": busy[0],
        "inference_busy_frac": busy[1],
        "steps_per_s": sps,
        "mixed_version_frac": 0.0,
        "mean_ess": ess,
        "min_ess": ess - 0.1,
        "mean_lag": 0.0,
        "max_lag": 0,
    }


def test_a_missed_target_counts_as_slower_than_any_hit():
    assert st.median_range([30.0, None, 10.0]) == (30.0, 10.0, None)  # max unknown: one seed never got there
    assert st.median_range([None, None, 10.0])[0] is None  # most seeds missed: no median
    assert st.median_range([20.0, 10.0, 40.0]) == (20.0, 10.0, 40.0)


def test_aggregate_takes_medians_ranges_and_the_worst_ess():
    agg = st.aggregate([run(10.0, ess=0.9), run(30.0, ess=0.95), run(20.0, ess=1.0)])
    assert agg["time_to_target_s"] == 20.0 and agg["time_to_target_s_range"] == [10.0, 30.0]
    assert agg["reached_target"] == 3 and agg["n_seeds"] == 3
    assert agg["mean_ess"] == pytest.approx(0.95) and agg["min_ess"] == pytest.approx(0.8)
    assert agg["time_to_targets_s"] == {"0.5": 20.0, "0.8": None}


def test_bound_is_two_for_balanced_sides_and_one_when_one_side_does_everything():
    assert st.overlap_bound(0.5, 0.5) == pytest.approx(2.0)
    assert st.overlap_bound(0.64, 0.35) == pytest.approx(0.99 / 0.64)
    assert st.overlap_bound(0.0, 0.9) == pytest.approx(1.0)


def test_speedups_are_ratios_of_medians_against_g1_and_the_best_g():
    results = {
        "pipeline": st.aggregate([run(10.0), run(12.0), run(11.0)]),
        "conventional_G1": st.aggregate([run(20.0), run(22.0), run(24.0)]),
        "conventional_G4": st.aggregate([run(16.0), run(15.5), run(100.0)]),
    }
    st.speedups(results)
    p = results["pipeline"]
    assert p["speedup_vs_conventional"] == pytest.approx(22.0 / 11.0)
    assert p["speedup_vs_best_conventional"] == pytest.approx(16.0 / 11.0)
    assert results["conventional_G1"]["speedup_vs_conventional"] == pytest.approx(1.0)
    text = ls.table(results, 0.5, 10, st.overlap_bound(0.6, 0.4), 3)
    assert "Bound B = 1.67" in text and "pipeline reached 2.00x conventional G=1, 1.20 B" in text
    # the fastest conventional G of those run (median 16.0 against G=1's 22.0) is named
    assert p["best_conventional"] == "conventional_G4" and "Best conventional G (the fastest of those run): " in text


def test_the_colocated_baseline_is_compared_but_never_counted_as_a_conventional_g():
    results = {
        "pipeline": st.aggregate([run(10.0), run(12.0), run(11.0)]),
        "conventional_G1": st.aggregate([run(20.0), run(22.0), run(24.0)]),
        "colocated": st.aggregate([run(13.0), run(14.0), run(15.0)]),  # faster than any conventional G
    }
    st.speedups(results)
    p = results["pipeline"]
    assert p["speedup_vs_colocated"] == pytest.approx(14.0 / 11.0)
    assert p["speedup_vs_best_conventional"] == pytest.approx(22.0 / 11.0)
    text = ls.table(results, 0.5, 10, st.overlap_bound(0.5, 0.5), 3, "reference")
    assert "(reference engine)" in text and "1.27x the colocated baseline" in text


def test_occupancy_is_the_median_over_busy_steps_and_absent_where_never_measured():
    def recs(occ: list[float | None]) -> list[dict]:
        out = []
        for i, o in enumerate(occ):
            r = {"reward_mean": 0.5, "wall_time_s": i + 1.0, "samples": 64 * (i + 1), "ess": 1.0, "lag_mean": 0.0}
            r.update({"lag_max": 0, "mixed_version_frac": 0.0, "trainer_busy_frac": 0.5, "inference_busy_frac": 0.5})
            if o is not None:
                r["inference_occupancy"] = o
            out.append(r)
        return out

    # a conventional G > 1 engine is idle through most steps: those carry no occupancy and must not count as 0
    s = st.summarise(recs([0.9, None, None, 0.7, 0.8]), 0.9, [], 2)
    assert s["inference_occupancy"] == pytest.approx(0.8)
    assert st.summarise(recs([None, None]), 0.9, [], 2)["inference_occupancy"] is None
    agg = st.aggregate([{**run(10.0), "inference_occupancy": x} for x in (0.7, None, 0.9)])
    assert agg["inference_occupancy"] == pytest.approx(0.8)
    results = {"pipeline": agg}
    st.speedups(results)
    assert "| 0.80 |" in ls.table(results, 0.5, 10, None, 3)


def alternating_steps(n: int, gen: float, train: float, push: float) -> list[dict]:
    """Step records of strictly alternating sides (conventional G=1), built as the job logs them: the trainer's step
    runs from the end of the last one (wait for data: the engine generates `gen` s; then it trains `train` s and pushes
    `push` s, the engine paused meanwhile); the engine's stats arrive with its last group, so its window runs from its
    previous send to this one (the first from its start)."""
    out, t = [], 0.0
    for i in range(n):
        elapsed = gen if i == 0 else train + push + gen  # the engine idled through the last step's training and push
        t += gen + train + push
        step = gen + train + push
        out.append(
            {
                "reward_mean": 0.5,
                "wall_time_s": t,
                "samples": 64 * (i + 1),
                "ess": 1.0,
                "lag_mean": 0.0,
                "lag_max": 0,
                "mixed_version_frac": 0.0,
                "trainer_busy_frac": (train + push) / step,
                "inference_busy_frac": gen / elapsed,
                "inference_busy_s": gen,
                "inference_elapsed_s": elapsed,
                "inference_engines": 1,
                "inference_occupancy": 0.5,
            }
        )
    return out


@pytest.mark.parametrize("gen,train,push", [(1.0, 1.0, 0.0), (3.0, 1.0, 0.2), (0.5, 2.0, 0.1)])
def test_the_busy_fractions_of_alternating_sides_sum_to_one(gen, train, push):
    s = st.summarise(alternating_steps(12, gen, train, push), 0.9, [], 2)
    # each side busy exactly while the other waits: the run's two fractions are gen / (gen + train + push) and the
    # rest, whatever the windows their stats come in
    assert s["trainer_busy_frac"] == pytest.approx((train + push) / (gen + train + push))
    assert s["inference_busy_frac"] == pytest.approx(gen / (gen + train + push))
    assert s["trainer_busy_frac"] + s["inference_busy_frac"] == pytest.approx(1.0)
    # the step-time weighting of the engines' own-window fractions (the old definition) sums above 1 here, and so
    # does their busy over their own elapsed seconds (their window ends before the last step's training)
    steps = alternating_steps(12, gen, train, push)
    old = st.time_weighted_mean(steps, "inference_busy_frac")
    own = sum(r["inference_busy_s"] for r in steps) / sum(r["inference_elapsed_s"] for r in steps)
    assert old + s["trainer_busy_frac"] > 1.0 + 1e-3 and own + s["trainer_busy_frac"] > 1.0 + 1e-3


def test_occupancy_is_the_busy_weighted_mean_of_the_steps():
    recs = alternating_steps(4, 1.0, 1.0, 0.0)
    for r, (busy, occ) in zip(recs, [(1.0, 0.2), (3.0, 0.6), (1.0, 0.2), (0.0, None)]):
        r["inference_busy_s"], r["inference_occupancy"] = busy, occ
        if occ is None:
            del r["inference_occupancy"]
    # sequence-seconds over busy seconds: (0.2 + 1.8 + 0.2) / 5
    assert st.summarise(recs, 0.9, [], 2)["inference_occupancy"] == pytest.approx(2.2 / 5)


def test_crossing_interpolates_between_the_exports_around_the_first_hit():
    xs, ys = [0.0, 10.0, 20.0, 30.0], [0.7, 0.8, 0.9, 0.85]
    assert heldout.crossing(xs, ys, 0.85) == pytest.approx(15.0)  # halfway from 0.8 (t=10) to 0.9 (t=20)
    assert heldout.crossing(xs, ys, 0.9) == pytest.approx(20.0)
    assert heldout.crossing(xs, ys, 0.6) == 0.0  # already there at the start
    assert heldout.crossing(xs, ys, 0.95) is None
    # the first crossing counts, not a later dip and rise
    assert heldout.crossing([0, 1, 2, 3], [0.5, 0.9, 0.6, 0.95], 0.8) == pytest.approx(0.75)


def step_records(rewards: list[float], step_s: float = 2.0, batch: int = 64) -> list[dict]:
    out = []
    for i, x in enumerate(rewards):
        r = {"reward_mean": x, "wall_time_s": step_s * (i + 1), "samples": batch * (i + 1), "ess": 1.0}
        r.update({"lag_mean": 1.0, "lag_max": 2, "mixed_version_frac": 0.0})
        r.update({"trainer_busy_frac": 0.5, "inference_busy_frac": 0.5})
        out.append(r)
    return out


def test_with_a_held_out_curve_the_targets_are_of_accuracy_and_the_reward_is_kept_beside():
    recs = step_records([0.5, 0.6, 0.7, 0.8, 0.9, 0.9])
    # exports every 2 steps; accuracy crosses 0.85 halfway between steps 2 and 4 (t = 4 s and 8 s)
    curve = {"step": [0, 2, 4, 6], "wall_time_s": [0.0, 4.0, 8.0, 12.0], "samples": [0, 128, 256, 384]}
    curve["accuracy"] = [0.75, 0.8, 0.9, 0.92]
    s = st.summarise(recs, 0.85, [0.9], 1, curve, [0.8])
    assert s["time_to_target_s"] == pytest.approx(6.0) and s["samples_to_target"] == pytest.approx(192.0)
    assert s["time_to_targets_s"] == {"0.85": pytest.approx(6.0), "0.9": pytest.approx(8.0)}
    # the sampled reward's own first step at 0.8 (step 4, t = 8 s): later than the policy's, as under lag
    assert s["reward_time_to_targets_s"] == {"0.8": 8.0}
    assert s["final_accuracy"] == 0.92
    # without a curve the same targets are of the sampled reward
    assert st.summarise(recs, 0.85, [], 1)["time_to_target_s"] == 10.0


def test_the_table_says_which_quantity_the_targets_are_of():
    def seed(t: float) -> dict:
        s = st.summarise(
            step_records([0.5, 0.9]),
            0.85,
            [],
            1,
            {"wall_time_s": [0.0, t], "samples": [0, 64], "accuracy": [0.8, 0.9], "step": [0, 1]},
            [0.8],
        )
        return s

    results = {
        "pipeline": st.aggregate([seed(2.0), seed(4.0), seed(6.0)]),
        "conventional_G1": st.aggregate([seed(8.0), seed(8.0), seed(10.0)]),
    }
    st.speedups(results)
    p = results["pipeline"]
    assert p["final_accuracy"] == 0.9 and p["reward_time_to_targets_s"] == {"0.8": 4.0}
    assert p["speedup_vs_conventional"] == pytest.approx(4.0 / 2.0)  # medians: 4.0 / 2.0 (t at 0.85 = t / 2)
    assert p["reward_speedup_vs_conventional_per_target"] == {"0.8": pytest.approx(1.0)}
    text = ls.table(results, 0.85, 1, 2.0, 3, "reference", "held-out greedy accuracy (256 problems)")
    assert "target: held-out greedy accuracy (256 problems), >= 0.85" in text
    assert "sampled reward @0.8: time / speedup" in text and "| 0.900 |" in text


def test_the_curve_pairs_exports_with_their_steps_and_stops_at_the_highest_target(tmp_path):
    import json

    from benchmarks.heldout import Evaluator

    recs = [{"step": i, "wall_time_s": 1.5 * i, "samples": 64 * i} for i in range(1, 9)]
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    acc = {2: 0.8, 4: 0.9, 6: 0.85, 8: 0.95}
    for step in (2, 4, 6):
        (tmp_path / "exports" / f"step-{step:07d}").mkdir(parents=True)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    ev = Evaluator.__new__(Evaluator)  # no task or model: the accuracy of a folder is looked up
    ev.workers, ev._pool = 1, None
    seen = []

    def accuracy(folder):
        seen.append(folder.name)
        return acc[8 if folder.name == "final" else int(folder.name.removeprefix("step-"))]

    ev.accuracy = accuracy
    c = ev.curve(tmp_path, 0.7)
    assert c["step"] == [0, 2, 4, 6, 8] and c["wall_time_s"] == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert c["samples"] == [0, 128, 256, 384, 512] and c["accuracy"] == [0.7, 0.8, 0.9, 0.85, 0.95]
    seen.clear()
    c = ev.curve(tmp_path, 0.7, until=0.9)  # step 6 is not needed for any target up to 0.9; final/ always is
    assert c["step"] == [0, 2, 4, 8] and seen == ["step-0000002", "step-0000004", "final"]


def test_exports_evaluated_in_parallel_give_the_same_curve(tmp_path):
    """Two at a time: an export evaluated after the crossing in the same batch stays off the curve, the last one
    is on it, and a warm start already at the target needs only the last."""
    import json

    from benchmarks.heldout import Evaluator

    recs = [{"step": i, "wall_time_s": 1.5 * i, "samples": 64 * i} for i in range(1, 11)]
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    acc = {2: 0.8, 4: 0.9, 6: 0.85, 8: 0.87, 10: 0.95}
    for step in (2, 4, 6, 8):
        (tmp_path / "exports" / f"step-{step:07d}").mkdir(parents=True)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    ev = Evaluator.__new__(Evaluator)
    ev.workers, ev._pool = 2, None
    batches = []

    def accuracies(folders):
        batches.append([f.name for f in folders])
        return [acc[10 if f.name == "final" else int(f.name.removeprefix("step-"))] for f in folders]

    ev.accuracies = accuracies
    c = ev.curve(tmp_path, 0.7)
    assert c["step"] == [0, 2, 4, 6, 8, 10] and c["accuracy"] == [0.7, 0.8, 0.9, 0.85, 0.87, 0.95]
    assert batches == [["step-0000002", "step-0000004"], ["step-0000006", "step-0000008"], ["final"]]
    batches.clear()
    c = ev.curve(tmp_path, 0.7, until=0.8)  # reached by the first of a batch: the second is evaluated, not kept
    assert c["step"] == [0, 2, 10] and c["accuracy"] == [0.7, 0.8, 0.95]
    assert batches == [["step-0000002", "step-0000004"], ["final"]]
    batches.clear()
    c = ev.curve(tmp_path, 0.7, until=0.9)
    assert c["step"] == [0, 2, 4, 10] and batches == [["step-0000002", "step-0000004"], ["final"]]
    batches.clear()
    c = ev.curve(tmp_path, 0.9, until=0.9)  # the warm start is there already
    assert c["step"] == [0, 10] and batches == [["final"]]


@pytest.mark.parametrize("task", sorted(tasks.TASK_SETTINGS))
def test_each_task_s_config_and_presets_load_as_one_job_config(task):
    """The presets are train_configs/ files layered over the task's config: each must exist and resolve to a job of
    that task (chain_sum: its long-tail settings; long_*: countdown, every step's rollouts dumped)."""
    from pipelinerl_fsdp.configure import load_config

    ts = tasks.TASK_SETTINGS[task]
    cfg = load_config(tasks.task_args(tasks.TASK_CONFIG[task], ts))
    assert cfg.task.name == {"long_tail": "countdown", "long_uniform": "countdown"}.get(task, task)
    if task.startswith("long_"):
        assert tasks.task_args(tasks.TASK_CONFIG[task], ts)[:2] == ["--config", task]  # the preset is the config
        assert cfg.task.lengths == {"long_tail": "tail", "long_uniform": "uniform"}[task]
        assert cfg.metrics.rollouts_every == 1
        full = {(r.mode, r.engine) for r in map(tasks.parse_mode, ts.full_modes.split(","))}
        # every split mode on both engines, colocated on its one (the fair benchmark)
        assert {(m, e) for m in ("pipeline", "conventional", "async") for e in tasks.ENGINES} | {
            ("colocated", None)
        } == full
        assert ts.relative_targets and ts.eval_every == (1, 1)
    if task == "chain_sum":
        assert tasks.config_args("arithmetic", ts) == ["--config", "arithmetic", "--config", "chain_sum"]
        assert (cfg.task.max_terms, cfg.rl.batch_size, cfg.rl.waves, cfg.trainer.optimizer.lr) == (12, 128, 4, 1.5e-5)
        assert cfg.warmstart.path == "outputs/warmstart/chain_sum-debug-heldout1024"


def test_the_long_generation_numbers_are_summarised_per_run_and_merged_over_seeds():
    """Truncated ESS, blocked fractions and the lag by tenth per run (NaN steps and steps without the metric left
    out), then over seeds: the token-lag histograms merged before their percentiles are taken."""
    recs = step_records([0.5, 0.6, 0.7])
    nan = float("nan")
    extra = [
        {"ess_truncated": 0.9, "trainer_push_blocked_frac": 0.1, "inference_send_blocked_frac": 0.2, "lag_pos/1": 3.0},
        {"ess_truncated": 0.7, "trainer_push_blocked_frac": 0.3, "lag_pos/1": 1.0, "lag_pos/10": 0.5},
        {"ess_truncated": nan, "lag_pos/10": nan},
    ]
    for r, x in zip(recs, extra):
        r.update(x)
    s = st.summarise(recs, 0.9, [], 1)
    assert s["mean_ess_truncated"] == pytest.approx(0.8) and s["min_ess_truncated"] == pytest.approx(0.7)
    assert s["trainer_push_blocked_frac"] == pytest.approx(0.2)
    assert s["inference_send_blocked_frac"] == pytest.approx(0.2)  # the one step that logged it
    assert s["lag_by_tenth"] == {"1": pytest.approx(2.0), "10": pytest.approx(0.5)}
    assert s["curve"]["ess_truncated"][:2] == [0.9, 0.7]
    old = st.summarise(step_records([0.5]), 0.9, [], 1)  # a run from before these metrics
    assert old["mean_ess_truncated"] is None and old["trainer_push_blocked_frac"] is None and old["lag_by_tenth"] == {}

    seeds = [
        {**run(10.0), "token_lag": {"hist": {"0": 6, "1": 2}}, "lag_by_tenth": {"1": 2.0}, "mean_ess_truncated": 0.8,
         "min_ess_truncated": 0.7, "trainer_push_blocked_frac": 0.2, "inference_send_blocked_frac": 0.1},
        {**run(20.0), "token_lag": {"hist": {"1": 1, "4": 1}}, "lag_by_tenth": {"1": 4.0, "10": 1.0},
         "mean_ess_truncated": 0.6, "min_ess_truncated": 0.5, "trainer_push_blocked_frac": 0.4,
         "inference_send_blocked_frac": 0.3},
    ]  # fmt: skip
    agg = st.aggregate(seeds)
    # merged: {0: 6, 1: 3, 4: 1}, 10 tokens; cumulative 6, 9, 10: p50 at lag 0, p90 (9 tokens) at lag 1
    assert (agg["token_lag"]["p50"], agg["token_lag"]["p90"], agg["token_lag"]["max"]) == (0, 1, 4)
    assert agg["token_lag"]["hist"] == {"0": 6, "1": 3, "4": 1} and agg["token_lag"]["tokens"] == 10
    assert agg["lag_by_tenth"] == {"1": pytest.approx(3.0), "10": pytest.approx(1.0)}
    assert agg["mean_ess_truncated"] == pytest.approx(0.7) and agg["min_ess_truncated"] == pytest.approx(0.5)
    assert agg["trainer_push_blocked_frac"] == pytest.approx(0.3)
    results = {"pipeline": agg}
    st.speedups(results)
    text = ls.lag_table(results)
    assert "| pipeline | 0 / 1 / 4 | 10 |" in text and "| 3.00 | 1.00 |" in text
    assert ls.lag_table({"pipeline": st.aggregate([run(10.0)])}) == ""  # no dumps: no second table


def test_busy_fractions_are_fractions_of_the_run_s_time_not_means_of_the_steps():
    # conventional G=4's shape: one long step that generates (engine busy 0.9 of its 40 s) and three short ones that
    # only train (engine idle over their 4 s each); by hand: engine busy (0.9 * 40) / 52, trainer (0.1 * 40 + 3 * 4
    # * 0.95) / 52
    walls, engine, trainer = [40.0, 44.0, 48.0, 52.0], [0.9, 0.0, 0.0, 0.0], [0.1, 0.95, 0.95, 0.95]
    recs = [
        {"step": i + 1, "wall_time_s": w, "samples": 64 * (i + 1), "reward_mean": 0.5, "ess": 1.0, "lag_mean": 0.0,
         "lag_max": 0, "mixed_version_frac": 0.0, "trainer_busy_frac": t, "inference_busy_frac": e}
        for i, (w, e, t) in enumerate(zip(walls, engine, trainer))
    ]  # fmt: skip
    r = st.summarise(recs, 0.9, [], 2)
    assert r["inference_busy_frac"] == pytest.approx(0.9 * 40 / 52)
    assert r["trainer_busy_frac"] == pytest.approx((0.1 * 40 + 3 * 4 * 0.95) / 52)
    assert st.time_weighted_mean(recs, "absent") is None
