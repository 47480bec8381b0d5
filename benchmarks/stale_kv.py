"""Stale KV, measured: the pipeline job with the KV cache of sequences in flight kept at every update, recomputed
at every update, or recomputed once more than K versions old (`inference.kv_max_age` = -1, 0, K), over seeds.

    python -m benchmarks.stale_kv --task chain_sum --quick            # the long-tail task, 3 seeds per setting
    python -m benchmarks.stale_kv --task long_tail                    # the long-generation preset: ages -1, 0, 1, 4
    python -m benchmarks.stale_kv --ages=-1,0 --seeds 5 -- --steps 32  # after --: more learning_speed options

Each setting is one `learning_speed --modes pipeline` run (its task preset, warm start, exports and held-out
greedy evaluation) with `--extra=--inference.kv_max_age=K`, into OUT/age<K>/ (a setting whose
`learning_speed.json` exists is not run again). The table per setting: time to the task's held-out target (median
and range over seeds), final accuracy, ESS, lag, the share of sequences spanning an update, and from every step's
metrics: `mismatch_kl_after_update` (engine vs trainer on lag-0 tokens sampled after an update within their
sequence: what a kept cache changes), `mismatch_kl` over all lag-0 tokens and by position in the completion,
sequences recomputed per step, the mean pause per update (where the engines recompute), the engines' tokens
per busy second and, on the long-generation tasks (`--task long_tail`: ages -1, 0, 1, 4 by default), the whole run's
token lag p50 / p90 / max from the rollout dumps.
Writes stale_kv.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, read_metrics, report
from pipelinerl_fsdp.rl.loss import position_bin_names

# the default ages of the long-generation tasks: their longest sequences span several updates, so a cache kept up
# to 4 versions old is a setting of its own
LONG_AGES = {"long_tail": "-1,0,1,4", "long_uniform": "-1,0,1,4"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="chain_sum", help="learning_speed's --task")
    p.add_argument(
        "--ages",
        default=None,
        help="comma list of inference.kv_max_age settings (default: -1,0,1; -1,0,1,4 on the long-generation tasks, "
        "whose sequences span several updates)",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="learning_speed --quick (fewer steps, smaller eval set)")
    p.add_argument("--summarise", action="store_true", help="no runs: the table from what --out holds")
    p.add_argument("--out", type=Path, default=RESULTS / "stale_kv")
    p.add_argument("more", nargs="*", help="more learning_speed options, after --")
    return p.parse_args()


def finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else float("nan")


def setting_summary(folder: Path) -> dict:
    """learning_speed.json's pipeline numbers plus the stale-KV metrics of every run's steps."""
    saved = json.loads((folder / "learning_speed.json").read_text())
    mode = saved["modes"]["pipeline"]
    recs = [
        r
        for run in sorted((folder / "runs").glob("pipeline_seed*"))
        for r in read_metrics(run / "rl" / "metrics.jsonl")
    ]
    recs = [r for r in recs if "ess" in r]
    return {
        "time_to_target_s": mode["time_to_target_s"],
        "time_to_target_range": mode["time_to_target_s_range"],
        "reached": f"{mode['reached_target']}/{mode['n_seeds']}",
        "final_accuracy": mode.get("final_accuracy"),
        "mean_ess": mode["mean_ess"],
        "min_ess": mode["min_ess"],
        "mean_lag": mode["mean_lag"],
        # the whole run's token lag (rollout dumps: the long-generation tasks), every seed's tokens together
        "token_lag": {k: mode["token_lag"][k] for k in ("p50", "p90", "max")} if "token_lag" in mode else None,
        "mixed_version_frac": mode["mixed_version_frac"],
        "mismatch_kl_after_update": finite_mean([r.get("mismatch_kl_after_update") for r in recs]),
        "lag0_after_update_frac": finite_mean([r.get("lag0_after_update_frac") for r in recs]),
        "mismatch_kl": finite_mean([r.get("mismatch_kl") for r in recs]),
        "kv_recomputed_per_step": finite_mean([r.get("kv_recomputed_seqs") for r in recs]),
        # recomputing happens inside the update's pause, so the busy rate below cannot show its cost; this does
        "update_pause_ms": finite_mean([r.get("update_pause_ms") for r in recs]),
        "mismatch_kl_by_position": {
            name: finite_mean([r.get(f"mismatch_kl_pos/{name}") for r in recs]) for name in position_bin_names()
        },
        "gen_tokens_per_busy_s": statistics.median(
            [r["gen_tokens_per_busy_s"] for r in recs if math.isfinite(r["gen_tokens_per_busy_s"])]
        ),
        "steps_per_s": mode["steps_per_s"],
        "target": saved["settings"].get("target"),
    }


def main() -> None:
    a = parse_args()
    ages = [int(x) for x in (a.ages or LONG_AGES.get(a.task, "-1,0,1")).split(",")]
    results = {}
    for age in ages:
        folder = a.out / f"age{age}"
        if not a.summarise and not (folder / "learning_speed.json").exists():
            cmd = [sys.executable, "-m", "benchmarks.learning_speed", "--task", a.task, "--modes",
                   "pipeline", "--seeds", str(a.seeds), f"--extra=--inference.kv_max_age={age}", "--out", str(folder),
                   *(["--quick"] if a.quick else []), *a.more]  # fmt: skip
            print(f"kv_max_age={age}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
        if (folder / "learning_speed.json").exists():
            results[age] = setting_summary(folder)

    def fmt(x: float | None, spec: str = ".3g") -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    columns = ["kv_max_age", "time to target s (range)", "reached", "final acc", "ESS mean (min)", "lag mean",
               "token lag p50/p90/max", "mixed-version seqs", "mismatch_kl after update", "share of lag-0 after update",
               "mismatch_kl all lag-0",
               "recomputed seqs/step", "pause per update ms", "gen tokens/busy s", "steps/s",
               *(f"mismatch_kl pos {name}" for name in position_bin_names())]  # fmt: skip
    rows = []
    for age, r in results.items():
        lo, hi = r["time_to_target_range"]
        rows.append([age, f"{fmt(r['time_to_target_s'], '.1f')} ({fmt(lo, '.1f')}-{fmt(hi, '.1f')})", r["reached"],
                     fmt(r["final_accuracy"]), f"{r['mean_ess']:.4f} ({r['min_ess']:.3f})", fmt(r["mean_lag"]),
                     "/".join(str(r["token_lag"][k]) for k in ("p50", "p90", "max")) if r["token_lag"] else "-",
                     fmt(r["mixed_version_frac"]), fmt(r["mismatch_kl_after_update"]),
                     fmt(r["lag0_after_update_frac"]), fmt(r["mismatch_kl"]), fmt(r["kv_recomputed_per_step"]),
                     fmt(r["update_pause_ms"], ".1f"), fmt(r["gen_tokens_per_busy_s"], ".0f"), fmt(r["steps_per_s"]),
                     *(fmt(r["mismatch_kl_by_position"][name]) for name in position_bin_names())])  # fmt: skip
    target = next(iter(results.values()))["target"] if results else None
    title = f"Stale KV on {a.task}: pipeline, {a.seeds} seeds per setting, held-out target {target}"
    report(a.out / "stale_kv.json", title, columns, rows, {"settings": vars(a) | {"out": str(a.out)}, "ages": results})


if __name__ == "__main__":
    main()
