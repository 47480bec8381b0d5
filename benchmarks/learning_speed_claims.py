"""`benchmarks.learning_speed`'s claims: pipeline against each other mode family at that family's best, as paired
per-seed ratios with a bootstrap interval (`learning_speed_stats.paired_ratio`).

A family is a mode whatever its G, staleness bound or engine (conventional_G4@reference is conventional); its best is
the variant with the shortest median time to the main target among those run (chosen on the same runs, which favours
the baseline: the claim is conservative). Two views: every engine allowed (each mode at its best engine), and one
engine at a time (the engine whose decode cost shape is a GPU's is the one the regime's claims are stated on:
`benchmarks/engine_cost.py`).
"""

from __future__ import annotations

import math

from benchmarks.learning_speed_stats import paired_ratio

FAMILIES = ("conventional", "async", "colocated")


def family(name: str) -> str:
    """The mode of a run name: `conventional_G4@vllm` -> conventional."""
    return name.split("@")[0].split("_")[0]


def engine_of(name: str, default: str) -> str:
    """The engine of a run name (`@ENGINE`; the colocated mode always runs the reference engine), else `default`."""
    if family(name) == "colocated":
        return "reference"
    return name.split("@")[1] if "@" in name else default


def fastest(results: dict[str, dict], names: list[str]) -> str | None:
    """Of `names`, the one with the shortest median time to the main target (a missed median counts as slowest)."""
    timed = [n for n in names if results[n]["time_to_target_s"] is not None]
    return min(timed, key=lambda n: results[n]["time_to_target_s"]) if timed else None


def claims(results: dict[str, dict], default_engine: str) -> list[dict]:
    """Pipeline's best against each family's best: every engine together, then each engine alone. Each claim holds
    the two run names, the paired ratio of the time to the main target (and of steps per second)."""
    engines = sorted({engine_of(n, default_engine) for n in results})
    views = [("each mode at its best engine", None)] + [(f"{e} engine only", e) for e in engines]
    out = []
    for view, engine in views:
        names = [n for n in results if engine is None or engine_of(n, default_engine) == engine]
        pipe = fastest(results, [n for n in names if family(n) == "pipeline"])
        if pipe is None:
            continue
        for fam in FAMILIES:
            base = fastest(results, [n for n in names if family(n) == fam])
            if base is None:
                continue
            b, p = results[base]["seeds"], results[pipe]["seeds"]
            time = paired_ratio(b, p)
            steps = [r["steps_per_s"] / s["steps_per_s"] for r, s in zip(p, b, strict=True)]
            out.append(
                {
                    "view": view,
                    "pipeline": pipe,
                    "baseline": base,
                    "time": time,
                    "steps_per_s_geo_mean": math.exp(sum(map(math.log, steps)) / len(steps)),
                }
            )
    return out


def claims_table(rows: list[dict], seeds: int) -> str:
    """The claims as markdown: per view, pipeline's run, the baseline's, the geometric mean of the paired ratios with
    its 95% bootstrap interval, whether the interval excludes 1, the per-seed ratios, the steps/s ratio."""
    head = (
        "| view | pipeline | against (its best) | time-to-target ratio, geo. mean [95% CI] | CI excludes 1 | "
        "per seed | steps/s ratio |"
    )
    lines = [
        f"Paired per-seed ratios (baseline's time to the main target / pipeline's, {seeds} seeds; > 1: pipeline "
        "faster); interval: bootstrap over seeds, 10,000 resamples. A run that missed the target counts with its whole "
        "wall time (a bound: `*`).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for c in rows:
        t = c["time"]
        star = "*" if t["censored"] else ""
        lines.append(
            f"| {c['view']} | {c['pipeline']} | {c['baseline']} | {t['geo_mean']:.2f}{star} "
            f"[{t['ci95'][0]:.2f}, {t['ci95'][1]:.2f}] | {'yes' if t['excludes_1'] else 'no'} | "
            + " / ".join(f"{x:.2f}" for x in t["per_seed"])
            + f" | {c['steps_per_s_geo_mean']:.2f} |"
        )
    return "\n".join(lines)
