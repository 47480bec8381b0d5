"""Does scoring stall generation? The same math job with math-verify rewards (a pool of worker processes) and
with exact string match (the cheapest possible reward), side by side over seeds.

    python -m benchmarks.reward_stall [--config math_tiny_cpu] [--runs 3] [--steps 20] \
        [--out benchmarks/results/reward_stall]

Per run: the engine's busy fraction (time with a request in flight, update pauses excluded) and its completion
tokens per second, averaged over the steps after the first two (start-up excluded), plus the outcome fractions.
If scoring held up the engine's loop, math-verify's runs would show a lower busy fraction and fewer tokens per
second than exact match's. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, read_metrics, report, run_job

REWARDS = ("exact_match", "math_verify")
OUTCOMES = ("correct", "wrong", "no_answer", "unparsable", "timeout", "truncated")


def summarise(recs: list[dict], skip: int) -> dict:
    steps = [r for r in recs if r["step"] > skip and "inference_busy_frac" in r]
    if not steps:
        raise SystemExit(f"no logged steps after step {skip}: raise --steps")

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steps)

    return {
        "inference_busy_frac": mean("inference_busy_frac"),
        "gen_tokens_per_s": mean("gen_tokens_per_s"),
        "trainer_busy_frac": mean("trainer_busy_frac"),
        **{f"outcome/{o}": mean(f"outcome/{o}") for o in OUTCOMES},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="math_tiny_cpu")
    p.add_argument("--runs", type=int, default=3, help="seeds per reward")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=2, help="first steps left out (engine start-up)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "reward_stall")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {r: [] for r in REWARDS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.runs):
            for reward in REWARDS:  # interleaved, so that a drift of the machine hits both alike
                out = Path(tmp) / f"{reward}-{seed}"
                args = [
                    "--config",
                    a.config,
                    f"--job.output_dir={out}",
                    f"--job.seed={seed}",
                    f"--task.reward={reward}",
                    f"--rl.max_steps={a.steps}",
                    "--metrics.log_every=1",
                ]
                run_job(args, a.out / f"{reward}-{seed}.log", a.nproc)
                s = summarise(read_metrics(out / "rl" / "metrics.jsonl"), a.skip)
                runs[reward].append(s)
                print(
                    f"{reward:12s} seed {seed}: busy {s['inference_busy_frac']:.3f}, {s['gen_tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
    rows = []
    for reward, rs in runs.items():
        busy = [r["inference_busy_frac"] for r in rs]
        tps = [r["gen_tokens_per_s"] for r in rs]
        rows.append(
            {
                "reward": reward,
                "busy_median": statistics.median(busy),
                "busy_range": [min(busy), max(busy)],
                "tok_s_median": statistics.median(tps),
                "tok_s_range": [min(tps), max(tps)],
                "correct": statistics.fmean(r["outcome/correct"] for r in rs),
                "no_answer": statistics.fmean(r["outcome/no_answer"] for r in rs),
            }
        )
    base, mv = rows
    ratio_busy = mv["busy_median"] / base["busy_median"]
    ratio_tps = mv["tok_s_median"] / base["tok_s_median"]
    print(f"\n{a.config}, {a.runs} seeds x {a.steps} steps per reward (steps 1-{a.skip} left out)\n")
    table = [
        [r["reward"], f"{r['busy_median']:.3f} ({r['busy_range'][0]:.3f}-{r['busy_range'][1]:.3f})",
         f"{r['tok_s_median']:.0f} ({r['tok_s_range'][0]:.0f}-{r['tok_s_range'][1]:.0f})", round(r["correct"], 3),
         round(r["no_answer"], 3)]
        for r in rows
    ]  # fmt: skip
    print(f"\nmath_verify / exact_match: busy {ratio_busy:.3f}x, tokens/s {ratio_tps:.3f}x")
    result = {
        "config": a.config,
        "runs": a.runs,
        "steps": a.steps,
        "skip": a.skip,
        "per_run": runs,
        "summary": rows,
        "math_verify_over_exact_busy": ratio_busy,
        "math_verify_over_exact_tokens_per_s": ratio_tps,
    }
    report(
        a.out / "reward_stall.json",
        "Reward stall: engine busy and tokens/s with math-verify against exact match",
        ["reward", "engine busy (median, range)", "completion tok/s (median, range)", "correct", "no answer"],
        table,
        result,
    )


if __name__ == "__main__":
    main()
