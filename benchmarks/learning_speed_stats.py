"""`benchmarks.learning_speed`'s statistics: one run's numbers from its step metrics and held-out curve
(`summarise`), a mode's over its seeds (`aggregate`: medians that count a missed target as slower than any hit), the
overlap bound B and the speed-ups between modes' medians."""

from __future__ import annotations

import math
import random
import statistics

from benchmarks.heldout import crossing
from benchmarks.token_lag import lag_summary, merge


def moving_average(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def first_hit(smooth: list[float], target: float, window: int) -> int | None:
    """Index of the first step whose moving average (over a full window) reaches `target`."""
    return next((i for i, v in enumerate(smooth) if i + 1 >= window and v >= target), None)


def summarise(
    recs: list[dict],
    target: float,
    more_targets: list[float],
    window: int,
    curve: dict[str, list[float]] | None = None,
    reward_targets: list[float] = (),
) -> dict:
    """Per-mode numbers from its metrics.jsonl records (one per optimizer step) and, when given, its held-out
    accuracy curve (`heldout.Evaluator.curve`). The targets (main first) apply to the curve when there is one
    (the time at which its linear interpolation first reaches them), else to the sampled reward's moving average;
    with a curve the sampled reward's times to `reward_targets` are kept as `reward_time_to_targets_s`."""
    steps = [r for r in recs if "reward_mean" in r]
    smooth = moving_average([r["reward_mean"] for r in steps], window)
    targets = sorted({target, *more_targets})

    def reward_hits(ts: list[float]) -> dict[str, tuple[float | None, float | None]]:
        out = {}
        for t in ts:
            i = first_hit(smooth, t, window)
            out[str(t)] = (None, None) if i is None else (steps[i]["wall_time_s"], steps[i]["samples"])
        return out

    if curve is None:
        hits = reward_hits(targets)
    else:
        acc = curve["accuracy"]
        hits = {str(t): (crossing(curve["wall_time_s"], acc, t), crossing(curve["samples"], acc, t)) for t in targets}
    tail = steps[-window:]

    def mean(key: str, rows: list[dict] = steps) -> float:
        return sum(r[key] for r in rows) / len(rows)

    occupancy = [r["inference_occupancy"] for r in steps if "inference_occupancy" in r]  # steps the engine was busy
    ess_truncated = [r["ess_truncated"] for r in steps if math.isfinite(r.get("ess_truncated", math.nan))]

    out = {
        "steps": len(steps),
        "wall_s": steps[-1]["wall_time_s"],
        "time_to_target_s": hits[str(target)][0],
        "samples_to_target": hits[str(target)][1],
        "time_to_targets_s": {t: h[0] for t, h in hits.items()},
        "final_reward": mean("reward_mean", tail),
        "mean_ess": mean("ess"),
        "min_ess": min(r["ess"] for r in steps),
        "mean_lag": mean("lag_mean"),
        "max_lag": max(r["lag_max"] for r in steps),
        "mixed_version_frac": mean("mixed_version_frac"),
        # multi-turn tasks: the mean lag of each model turn index (1, 2, ...) over the steps that had such turns
        "lag_by_turn": lag_by_turn(steps),
        # fractions of the run's time, not means of the steps' fractions: steps differ in length (conventional G > 1
        # generates G batches in its first step and trains the next G - 1 without generating)
        # Both as fractions of the run's wall time (the trainer's clock). The engines' busy seconds arrive with their
        # groups, over their own windows, not the trainer's steps: weighting their per-step fraction by the trainer's
        # step time misplaced the idle time of an alternating mode (conventional G=1's two fractions summed to 1.04).
        "trainer_busy_frac": time_weighted_mean(steps, "trainer_busy_frac"),
        "inference_busy_frac": engine_busy_frac(steps) or time_weighted_mean(steps, "inference_busy_frac"),
        # where each side waited on the other (absent from runs older than these metrics)
        "trainer_push_blocked_frac": time_weighted_mean(steps, "trainer_push_blocked_frac"),
        "inference_send_blocked_frac": time_weighted_mean(steps, "inference_send_blocked_frac"),
        # the truncated weights' ESS (what the loss uses) beside the raw one
        "mean_ess_truncated": statistics.fmean(ess_truncated) if ess_truncated else None,
        "min_ess_truncated": min(ess_truncated) if ess_truncated else None,
        # the mean lag of each tenth of the completion (1: its first tokens), over the steps that logged it
        "lag_by_tenth": mean_by_index(steps, "lag_pos/"),
        # the run's mean live sequences over the engines' busy seconds, over `inference.max_num_seqs` (every mode)
        "inference_occupancy": busy_weighted(steps, "inference_occupancy")
        or (statistics.median(occupancy) if occupancy else None),
        "steps_per_s": len(steps) / max(steps[-1]["wall_time_s"], 1e-9),
        "curve": {
            "wall_time_s": [r["wall_time_s"] for r in steps],
            "samples": [r["samples"] for r in steps],
            "reward_mean": [r["reward_mean"] for r in steps],
            "reward_smooth": smooth,
            "ess": [r["ess"] for r in steps],
            "ess_truncated": [r.get("ess_truncated", math.nan) for r in steps],
            "lag_mean": [r["lag_mean"] for r in steps],
        },
    }
    if curve is not None:
        out["final_accuracy"] = curve["accuracy"][-1]
        out["eval_curve"] = curve
        out["reward_time_to_targets_s"] = {t: h[0] for t, h in reward_hits(list(reward_targets)).items()}
    return out


def lag_by_turn(steps: list[dict]) -> dict[str, float]:
    """Mean over the steps of `lag_turn/<i>` (a multi-turn task's lag of its episodes' i-th model turns)."""
    return mean_by_index(steps, "lag_turn/")


def mean_by_index(steps: list[dict], prefix: str) -> dict[str, float]:
    """Mean over the steps that logged it of each finite `<prefix><i>` (i = 1, 2, ...), by i in order."""
    out: dict[str, list[float]] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith(prefix) and v is not None and math.isfinite(v):
                out.setdefault(k[len(prefix) :], []).append(v)
    return {i: statistics.fmean(v) for i, v in sorted(out.items(), key=lambda kv: int(kv[0]))}


def engine_busy_frac(steps: list[dict]) -> float | None:
    """The engines' busy seconds per engine over the run's wall time (`inference_busy_s` summed over the steps, over
    `inference_engines` and the last step's `wall_time_s`); None for records without them."""
    if not steps or any(r.get("inference_busy_s") is None or not r.get("inference_engines") for r in steps):
        return None
    return sum(r["inference_busy_s"] / r["inference_engines"] for r in steps) / steps[-1]["wall_time_s"]


def busy_weighted(steps: list[dict], key: str) -> float | None:
    """Mean of a per-step quantity over the engines' busy time (`inference_busy_s` weights); None without it."""
    rows = [r for r in steps if r.get(key) is not None and r.get("inference_busy_s")]
    total = sum(r["inference_busy_s"] for r in rows)
    return sum(r[key] * r["inference_busy_s"] for r in rows) / total if total > 0 else None


def time_weighted_mean(steps: list[dict], key: str) -> float | None:
    """Mean of a per-step fraction `key` weighted by each step's wall time (`wall_time_s` is cumulative: the first
    step's own time is its value), over the steps that logged a finite value; None when none did. A fraction of
    each step's time becomes the fraction of the run's time."""
    num = den = 0.0
    prev = 0.0
    for r in steps:
        dur, prev = r["wall_time_s"] - prev, r["wall_time_s"]
        v = r.get(key)
        if v is not None and math.isfinite(v):
            num, den = num + v * dur, den + dur
    return num / den if den > 0 else None


def mean_over_seeds(per_seed: list[dict], key: str) -> dict[str, float]:
    """Per index, the mean over the seeds that have it of each seed's `key` mapping (index -> mean)."""
    keys = sorted({i for r in per_seed for i in r.get(key, {})}, key=int)
    return {i: statistics.fmean(r[key][i] for r in per_seed if i in r.get(key, {})) for i in keys}


def median_range(xs: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of per-seed values; a seed that never got there (None) counts as slower than any that
    did, so the median is None when half or more missed."""
    if not xs:
        return None, None, None
    inf = float("inf")
    vals = sorted(inf if x is None else x for x in xs)
    med = statistics.median(vals)
    hit = [v for v in vals if v != inf]
    return (None if med == inf else med), (min(hit) if hit else None), (None if vals[-1] == inf else vals[-1])


def aggregate(per_seed: list[dict]) -> dict:
    """One mode's numbers over its seeds: the median (and `<key>_range`: [min, max]) of each per-seed summary,
    ESS as the mean of the seeds' means and the minimum of any step, lag mean and max likewise."""
    out: dict = {"seeds": per_seed, "n_seeds": len(per_seed)}
    for key in (
        "time_to_target_s",
        "samples_to_target",
        "final_reward",
        "trainer_busy_frac",
        "inference_busy_frac",
        "steps_per_s",
        "mixed_version_frac",
    ):
        med, lo, hi = median_range([r[key] for r in per_seed])
        out[key], out[f"{key}_range"] = med, [lo, hi]
    out["reached_target"] = sum(r["time_to_target_s"] is not None for r in per_seed)
    if "final_accuracy" in per_seed[0]:
        med, lo, hi = median_range([r["final_accuracy"] for r in per_seed])
        out["final_accuracy"], out["final_accuracy_range"] = med, [lo, hi]
    for key, range_key in (
        ("time_to_targets_s", "time_to_targets_range"),
        ("reward_time_to_targets_s", "reward_time_to_targets_range"),
    ):
        if key not in per_seed[0]:
            continue
        out[key], ranges = {}, {}
        for t in per_seed[0][key]:
            med, lo, hi = median_range([r[key][t] for r in per_seed])
            out[key][t], ranges[t] = med, [lo, hi]
        out[range_key] = ranges
    out["mean_ess"] = statistics.fmean(r["mean_ess"] for r in per_seed)
    out["min_ess"] = min(r["min_ess"] for r in per_seed)
    occupancy = [r["inference_occupancy"] for r in per_seed if r.get("inference_occupancy") is not None]
    out["inference_occupancy"] = statistics.median(occupancy) if occupancy else None
    out["mean_lag"] = statistics.fmean(r["mean_lag"] for r in per_seed)
    out["max_lag"] = max(r["max_lag"] for r in per_seed)
    out["lag_by_turn"] = mean_over_seeds(per_seed, "lag_by_turn")
    out["lag_by_tenth"] = mean_over_seeds(per_seed, "lag_by_tenth")
    for key in ("trainer_push_blocked_frac", "inference_send_blocked_frac"):
        vals = [r[key] for r in per_seed if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    truncated = [r for r in per_seed if r.get("mean_ess_truncated") is not None]
    out["mean_ess_truncated"] = statistics.fmean(r["mean_ess_truncated"] for r in truncated) if truncated else None
    out["min_ess_truncated"] = min((r["min_ess_truncated"] for r in truncated), default=None)
    hists = [r["token_lag"]["hist"] for r in per_seed if "token_lag" in r]
    if hists:  # the seeds' tokens together: percentiles of the merged histogram
        out["token_lag"] = lag_summary(merge(hists))
    return out


def overlap_bound(trainer_busy: float, engine_busy: float) -> float:
    """B = (T_gen + T_train) / max(T_gen, T_train) from conventional G=1's busy fractions: the speed-up a perfect
    overlap of its two alternating sides would give (1: one side does all the work; 2: equal sides)."""
    return (trainer_busy + engine_busy) / max(trainer_busy, engine_busy)


def speedups(results: dict[str, dict]) -> None:
    """Add, to every mode in place: `speedup_vs_conventional` (conventional G=1's median time to target / this
    mode's), `speedup_vs_best_conventional` (the fastest conventional G of those run instead, named in
    `best_conventional`), the same per further target, and
    `throughput_vs_conventional` (median optimizer steps per second, a less noisy view of the same effect), and
    with a colocated run `speedup_vs_colocated`."""
    conv = {k: v for k, v in results.items() if k.startswith("conventional")}
    timed = {k: c["time_to_target_s"] for k, c in conv.items() if c["time_to_target_s"]}
    best_name = min(timed, key=timed.get, default=None)  # the fastest conventional G of those run
    # conventional G=1: the run named so, else (runs named with their engine) the first G=1 run
    g1 = [k for k in results if k == "conventional_G1" or k.startswith("conventional_G1@")]
    base = results[g1[0]] if g1 else None
    coloc = results.get("colocated")

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num and den else None

    for v in results.values():
        t = v["time_to_target_s"]
        best = timed.get(best_name)
        v["best_conventional"] = best_name
        v["speedup_vs_conventional"] = ratio(base and base["time_to_target_s"], t)
        v["speedup_vs_best_conventional"] = ratio(best, t)
        v["speedup_vs_conventional_per_target"] = {
            k: ratio(base and base["time_to_targets_s"][k], x) for k, x in v["time_to_targets_s"].items()
        }
        if "reward_time_to_targets_s" in v:  # the sampled reward's view, beside the held-out accuracy's
            v["reward_speedup_vs_conventional_per_target"] = {
                k: ratio(base and base["reward_time_to_targets_s"][k], x)
                for k, x in v["reward_time_to_targets_s"].items()
            }
        v["throughput_vs_conventional"] = ratio(v["steps_per_s"], base and base["steps_per_s"])
        if coloc is not None:
            v["speedup_vs_colocated"] = ratio(coloc["time_to_target_s"], t)


def paired_ratio(
    base: list[dict],
    runs: list[dict],
    key: str = "time_to_target_s",
    target: str | None = None,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """Per seed, base's time over this mode's (> 1: this mode is faster), the seeds paired by index (the same
    `job.seed`: problems and sampling); their geometric mean and its 95% bootstrap interval (seeds resampled with
    replacement, percentiles 2.5 / 97.5 of the resampled geometric means, a fixed generator: the same numbers every
    time). A run that never reached the target counts with its whole wall time, a bound on its time to target (the
    ratio is then a bound too: `censored` counts them). `target`: a further target's key in `time_to_targets_s`."""

    def time(r: dict) -> tuple[float, bool]:
        t = r[key] if target is None else r["time_to_targets_s"][target]
        return (r["wall_s"], True) if t is None else (t, False)

    ratios, censored = [], 0
    for b, r in zip(base, runs, strict=True):
        (tb, cb), (tr, cr) = time(b), time(r)
        ratios.append(tb / tr)
        censored += cb or cr
    logs = [math.log(x) for x in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return {
        "per_seed": ratios,
        "geo_mean": math.exp(statistics.fmean(logs)),
        "ci95": [math.exp(lo), math.exp(hi)],
        "excludes_1": math.exp(lo) > 1 or math.exp(hi) < 1,
        "censored": censored,
    }
