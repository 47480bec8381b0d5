"""Early-token lag and the objective: pipeline mode on the long-generation preset under named loss variants, over
seeds. In a long completion generated across several weight updates the first tokens are the oldest (the highest
lag); each variant treats those tokens differently (truncated or clipped importance weights, masks by ratio or by lag).

    python -m benchmarks.lag_objectives                          # every variant, long_tail, 3 seeds each
    python -m benchmarks.lag_objectives --variants baseline,lag_mask --seeds 5 -- --steps 40

Each variant is one `learning_speed --task TASK --modes pipeline` run (its preset, warm start, exports and held-out
greedy evaluation) with the variant's overrides as `--extra`, into OUT/<variant>/ (a variant whose
`learning_speed.json` exists is not run again); options after `--` go to every learning_speed run. A variant that
resolves to the same loss and RL settings as one listed before it (`reinforce_tis` while the preset's loss is
reinforce_tis with c = 5) is not run again: its row repeats that one's numbers, marked "= <that variant>".

Reports per variant: time and samples to the held-out target (median and range over seeds), raw and truncated ESS,
the ESS of the first and of the last tenth of the completions (`ess_pos/1`, `ess_pos/10`), their mean |log pi/mu|
(`abs_log_ratio_pos/1`, `/10`), the share of tokens the loss masked (`masked_frac`) and the token lag p50 / p90 / max
(rollout dumps). Writes lag_objectives.{json,md} under --out.
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
from benchmarks.learning_speed_tasks import TASK_CONFIG, TASK_SETTINGS, task_args
from pipelinerl_fsdp.configure import load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REFERENCE_PRESET = ROOT / "train_configs" / "pipelinerl_reference.toml"


def toml_overrides(path: Path, sections: tuple[str, ...]) -> tuple[str, ...]:
    """`--section.key=value` for every key of `sections` in a train_configs/ file (booleans as TOML writes them)."""
    data = tomllib.loads(path.read_text())

    def value(v: object) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return tuple(f"--{s}.{k}={value(v)}" for s in sections for k, v in data.get(s, {}).items())


# name -> the overrides of the preset's job it runs with
VARIANTS: dict[str, tuple[str, ...]] = {
    # the preset's own loss
    "baseline": (),
    # the PipelineRL paper's objective: importance weights truncated at c = 5 (rl/objectives/reinforce_tis.py)
    "reinforce_tis": ("--loss.name=reinforce_tis", "--loss.is_clip=5"),
    # the reference implementation's loss and advantages (cispo with the weight truncated at 1.02, leave-one-out
    # baseline, no std normalisation): train_configs/pipelinerl_reference.toml's [loss] and [rl] keys
    "reference": toml_overrides(REFERENCE_PRESET, ("loss", "rl")),
    # PPO's clipped ratio (eps 0.2 both sides)
    "ppo": ("--loss.name=ppo",),
    # tokens whose ratio pi/mu lies outside [0.5, 2] leave the loss (the loss config's bounds, stated)
    "token_mask": ("--loss.mask=token", "--loss.mask_low=0.5", "--loss.mask_high=2.0"),
    # whole sequences whose geometric-mean ratio lies outside [0.5, 2] leave the loss
    "sequence_mask": ("--loss.mask=sequence", "--loss.mask_low=0.5", "--loss.mask_high=2.0"),
    # tokens more than 4 versions older than the trained weights leave the loss
    "lag_mask": ("--loss.max_token_lag=4",),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="long_tail", help="learning_speed's --task")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="learning_speed --quick (fewer steps, smaller eval set)")
    p.add_argument("--summarise", action="store_true", help="no runs: the table from what --out holds")
    p.add_argument("--out", type=Path, default=RESULTS / "lag_objectives")
    p.add_argument("more", nargs="*", help="more learning_speed options, after --")
    return p.parse_args()


def resolved(task: str, overrides: tuple[str, ...]) -> tuple:
    """The loss and RL sections a variant's job resolves to (raises the config's error on an invalid variant)."""
    cfg = load_config([*task_args(TASK_CONFIG[task], TASK_SETTINGS[task]), *overrides])
    return cfg.loss, cfg.rl


def same_as(task: str, names: list[str]) -> dict[str, str]:
    """Variant -> the first variant listed before it that resolves to the same loss and RL settings."""
    seen: list[tuple[str, tuple]] = []
    out = {}
    for name in names:
        r = resolved(task, VARIANTS[name])
        twin = next((n for n, x in seen if x == r), None)
        if twin is None:
            seen.append((name, r))
        else:
            out[name] = twin
    return out


def step_mean(recs: list[dict], key: str) -> float | None:
    """Mean of `key` over the steps that logged a finite value; None when none did."""
    xs = [r[key] for r in recs if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.fmean(xs) if xs else None


def variant_summary(folder: Path) -> dict:
    """learning_speed.json's pipeline numbers plus the position-resolved ESS / ratio and the masked share of every
    run's steps (all seeds' steps together)."""
    saved = json.loads((folder / "learning_speed.json").read_text())
    mode = saved["modes"]["pipeline"]
    runs = sorted((folder / "runs").glob("pipeline_seed*"))
    recs = [r for run in runs for r in read_metrics(run / "rl" / "metrics.jsonl") if "ess" in r]
    lag = mode.get("token_lag")
    return {
        "time_to_target_s": mode["time_to_target_s"],
        "time_to_target_range": mode["time_to_target_s_range"],
        "samples_to_target": mode["samples_to_target"],
        "samples_to_target_range": mode["samples_to_target_range"],
        "reached": f"{mode['reached_target']}/{mode['n_seeds']}",
        "final_accuracy": mode.get("final_accuracy"),
        "mean_ess": mode["mean_ess"],
        "mean_ess_truncated": mode.get("mean_ess_truncated"),
        **{key: step_mean(recs, key) for key in POSITION_KEYS},
        "masked_frac": step_mean(recs, "masked_frac"),
        "token_lag": None if lag is None else {k: lag[k] for k in ("p50", "p90", "max")},
        "target": saved["settings"].get("target"),
    }


# the first and the last tenth of the completions
POSITION_KEYS = ("ess_pos/1", "ess_pos/10", "abs_log_ratio_pos/1", "abs_log_ratio_pos/10")


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def row(name: str, r: dict, twin: str | None) -> list[str]:
    """The table's row of one variant (`twin`: the variant whose run it repeats)."""
    t_lo, t_hi = r["time_to_target_range"]
    s_lo, s_hi = r["samples_to_target_range"]
    lag = r["token_lag"]
    return [
        name + (f" (= {twin})" if twin else ""),
        f"{fmt(r['time_to_target_s'], '.1f')} ({fmt(t_lo, '.1f')}-{fmt(t_hi, '.1f')})",
        f"{fmt(r['samples_to_target'], '.0f')} ({fmt(s_lo, '.0f')}-{fmt(s_hi, '.0f')})",
        r["reached"],
        fmt(r["final_accuracy"]),
        f"{r['mean_ess']:.4f} / {fmt(r['mean_ess_truncated'], '.4f')}",
        f"{fmt(r['ess_pos/1'], '.4f')} / {fmt(r['ess_pos/10'], '.4f')}",
        f"{fmt(r['abs_log_ratio_pos/1'])} / {fmt(r['abs_log_ratio_pos/10'])}",
        fmt(r["masked_frac"]),
        "-" if lag is None else f"{lag['p50']}/{lag['p90']}/{lag['max']}",
    ]


def main() -> None:
    a = parse_args()
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    twins = same_as(a.task, names)  # also checks that every variant is a valid config before anything runs
    results = {}
    for name in [n for n in names if n not in twins]:
        folder = a.out / name
        if not a.summarise and not (folder / "learning_speed.json").exists():
            cmd = [sys.executable, "-m", "benchmarks.learning_speed", "--task", a.task, "--modes", "pipeline",
                   "--seeds", str(a.seeds), *(f"--extra={x}" for x in VARIANTS[name]), "--out", str(folder),
                   *(["--quick"] if a.quick else []), *a.more]  # fmt: skip
            print(f"{name}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
        if (folder / "learning_speed.json").exists():
            results[name] = variant_summary(folder)
    rows = [row(n, results[twins.get(n, n)], twins.get(n)) for n in names if twins.get(n, n) in results]
    columns = ["variant", "time to target s (range)", "samples to target (range)", "reached", "final acc",
               "ESS raw / truncated", "ESS first / last tenth", "abs log ratio first / last tenth", "masked share",
               "token lag p50/p90/max"]  # fmt: skip
    target = next(iter(results.values()))["target"] if results else None
    title = f"Objectives under early-token lag on {a.task}: pipeline, {a.seeds} seeds per variant, target {target}"
    data = {"settings": vars(a) | {"out": str(a.out)}, "overrides": {n: VARIANTS[n] for n in names}, "same_as": twins}
    report(a.out / "lag_objectives.json", title, columns, rows, data | {"variants": results})


if __name__ == "__main__":
    main()
