"""Learning speed of the RL modes side by side: PipelineRL vs conventional (G = 1 and larger) vs async, over seeds.

Every mode runs the same job (`train_configs/arithmetic.toml` unless --config), on the same hardware split
(--nproc ranks, --inference-ranks of them engines), from the same warm start, with the same samples per optimizer
step, once per seed (`job.seed`: problems and sampling); only `rl.mode` and `rl.sync_every` (G) change. Runs go one
after another, seed by seed (every mode of seed 0, then of seed 1, ...), so a drift of the machine hits all modes.

Reports per mode, as the median and range over seeds: time to target at the main and further targets (the trainer's
wall clock, engine start-up excluded), samples to target, final accuracy and reward, ESS (mean, and the minimum of
any step), mean / max lag, busy fractions, engine occupancy (median over steps), optimizer steps per second;
`speedup_vs_conventional` = conventional G=1's median time to the target / this mode's,
`speedup_vs_best_conventional` against the fastest conventional G. The bound B = (T_gen + T_train) / max(T_gen,
T_train) comes from conventional G=1's busy fractions in the same run (its two sides take turns, so overlapping
them perfectly would take max instead of the sum). Writes `learning_speed.json`, `learning_speed.md`,
`learning_speed.png` (accuracy and reward vs time and vs samples, one curve per seed; ESS vs step) under --out;
TensorBoard: `tensorboard --logdir OUT/runs` shows one run per mode and seed.

The targets are of the held-out greedy accuracy (`--metric accuracy`, the default): every run exports its policy
every --eval-every steps (`checkpoint.export_every`), and after the run `benchmarks.heldout` evaluates the exports on a
fixed set of held-out problems (one export per core at a time); time to target is where the curve, linear between
exports, first reaches it. This measures the policy when it was trained, with little noise (the same problems for
every mode, greedy). The sampled reward (`--metric reward`: the first step at which its mean over the last --window
steps reaches the target) is reported beside it; in pipeline mode it is the reward of samples drawn `lag` versions
earlier, so it trails the policy by the lag and charges pipeline for a delay of the measurement.

  python -m benchmarks.learning_speed --quick                  # addition: 3 modes, 3 seeds
  python -m benchmarks.learning_speed --task chain_sum --quick # long tail (2..12-term worked sums): pipeline,
                                                               # conventional G=1 and colocated, 3 seeds, ~15 min
                                                               # + warm start (once, ~15 min)
  python -m benchmarks.learning_speed --task tool_arithmetic --quick  # multi-turn (a sandboxed Python tool):
                                                               # pipeline, conventional G=1 and async, 3 seeds

Mode `colocated` is the single-process baseline `python -m benchmarks.colocated` (`rl.mode = "colocated"`: generate
with every core, then train with every core; same config, data, step and metrics); `speedup_vs_colocated` compares
against it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import ROOT, pyplot, run_job, run_logged, save_figure
from benchmarks.heldout import Evaluator, crossing
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.runtime.torchrun import job_command


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and modes (about 15 min on 2 CPU cores)")
    p.add_argument(
        "--config",
        default=None,
        help="train_configs/ name or a TOML path (default: per task); the task's presets are layered over it",
    )
    p.add_argument("--task", choices=sorted(TASK_SETTINGS), default="addition")
    p.add_argument(
        "--modes", default=None, help="comma list of MODE[:G], e.g. pipeline,conventional:1,conventional:4,async"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument(
        "--engine",
        choices=["vllm", "reference"],
        default=None,
        help="inference.engine of every run (default: per task)",
    )
    p.add_argument(
        "--metric",
        choices=["accuracy", "reward"],
        default="accuracy",
        help="what the targets are of: held-out greedy accuracy of the policy exported every --eval-every steps "
        "(evaluated after each run, outside its time), or the sampled reward's moving average over --window steps",
    )
    p.add_argument(
        "--loss",
        default=None,
        help="loss.name of every run (rl/objectives/; default: the config's), e.g. --loss grpo; its keys: --extra",
    )
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems per evaluation (default: per task)")
    p.add_argument("--eval-every", type=int, default=None, help="optimizer steps between exports (default: per task)")
    p.add_argument("--target", type=float, default=None, help="main target of --metric (default: per task)")
    p.add_argument(
        "--more-targets",
        default=None,
        help="comma list of further targets also reported (default: per task); a single target "
        "on a noisy curve says little",
    )
    p.add_argument("--window", type=int, default=10, help="steps in the reward moving average")
    p.add_argument("--seeds", type=int, default=3, help="runs per mode (job.seed = --first-seed, then +1, ...)")
    p.add_argument("--first-seed", type=int, default=0, help="job.seed of the first run (to add seeds to a run)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--inference-ranks", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learning_speed")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        help="one more --section.key=value override for every run; repeat: --extra=--rl.lr=1e-5",
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="only draw --out's learning_speed.png from its learning_speed.json (e.g. after installing matplotlib)",
    )
    return p.parse_args()


@dataclass(frozen=True)
class TaskSettings:
    """What the benchmark needs to know of a task beyond its job config: the config's presets, its targets, its
    default steps, modes and evaluation sizes."""

    # train_configs/ layered, in order, over the task's config (`TASK_CONFIG`, or --config)
    presets: tuple[str, ...]
    # main target, further targets: of the held-out accuracy (--metric accuracy) and of the sampled reward
    accuracy_targets: tuple[float, str]
    reward_targets: tuple[float, str]
    quick_steps: int
    full_steps: int
    quick_modes: str
    # held-out problems evaluated per export (the first of the task's held-out split), and steps between exports
    # (quick, full)
    eval_size: tuple[int, int]
    eval_every: tuple[int, int]


TASK_SETTINGS = {
    "addition": TaskSettings(
        # the warm start's held-out greedy accuracy is 0.76, RL's plateau ~0.93
        (),
        (0.88, "0.86,0.9"),
        (0.8, "0.75,0.83"),
        200,
        400,
        "pipeline,conventional:1,conventional:4",
        (500, 500),
        (5, 5),
    ),
    # The long-tail task (its job settings: train_configs/chain_sum.toml): worked sums of 2-12 two-digit terms
    # (completions ~10-130 tokens), 128 samples per step.
    # The engine is the pure-PyTorch one: for this 0.8M model on one CPU core vLLM runs at 0.7-0.9x its speed (its
    # engine core and client add to the model's cost; benchmarks/engine_overhead.py). With it, conventional G=1's
    # two sides are balanced (trainer busy ~0.49, engine ~0.52); with vLLM (`--engine vllm`) the engine takes ~58%
    # of the work, for reasons of vLLM's overhead rather than of the task. The warm start stops at the first
    # evaluation (every 25 steps) at or above 0.75 held-out greedy accuracy on the 1024 problems the benchmark
    # evaluates (here: 725 steps, 0.789, ~15 min once): a fixed number of steps is not a fixed strength (the greedy
    # accuracy jumps by up to 0.16 between two evaluations 25 steps apart). 1024 held-out problems, not 256: near
    # the target the policy gains ~0.03 per 4 steps, within the noise of 256 problems (+-0.022); an export takes
    # ~10 s to evaluate on 1024 here, so --quick evaluates the first 512 (noisier).
    # RL learning rate 1.5e-5 (the config's 3e-5 halved): at 3e-5 every mode reached ~0.85 by step ~10 and then
    # plateaued at 0.84-0.87, so the main target sat on the plateau's edge (its crossing time bimodal from run to
    # run) and ~10 steps from the start, where pipeline's first step (which waits for a whole batch, like
    # conventional's) is a tenth of its time. At 1.5e-5 the same climb takes ~15 steps and crosses 0.85 on the
    # slope (docs/results.md). Targets: 0.85, and 0.83 / 0.86 (0.86 is near the plateau again). Every run evaluates its
    # exports up to the first that reaches the highest target, and the last (the full run's time limit: 60 min).
    # Pipeline and async take each batch in 4 parts (`rl.waves=4`): with whole batches a trainer-bound pipeline's
    # receive queue holds a whole step of groups that waited a step (lag ~1.75, mean ESS below conventional
    # G=4's); in parts the lag is ~1.0 and the ESS above G=4's, at the same time to target (docs/results.md: both full
    # runs). Conventional modes always take whole batches: their round is complete before training starts, and
    # parts would cost their step ~7% (more, smaller micro-batches).
    "chain_sum": TaskSettings(
        ("chain_sum",),
        (0.85, "0.83,0.86"),
        (0.8, "0.75,0.85"),
        24,
        32,
        "pipeline,conventional:1,colocated",
        (512, 1024),
        (4, 4),
    ),
}
TASK_SETTINGS["tool_arithmetic"] = TaskSettings(
    # The multi-turn task: chain sums of 3-8 two-digit terms with a sandboxed Python tool (tasks/tool_arithmetic.py).
    # Its config's warm start stops at 0.6 held-out greedy accuracy (the model calls the tool on about a third of the
    # problems); RL learns to call it on every one: greedy accuracy 0.61 -> 1.0 in 50 steps (reference engine).
    (),
    (0.9, "0.8,0.95"),
    (0.8, "0.7,0.9"),
    40,
    80,
    "pipeline,conventional:1,async",
    (256, 256),
    (5, 5),
)
# the engine of every run unless --engine says otherwise
TASK_ENGINE = {"addition": "vllm", "chain_sum": "reference", "tool_arithmetic": "reference"}
# the config of every run unless --config says otherwise
TASK_CONFIG = {"addition": "arithmetic", "chain_sum": "arithmetic", "tool_arithmetic": "tool_arithmetic"}


def config_args(config: str, ts: TaskSettings) -> list[str]:
    """`--config` of the task's config, then of each of its presets (layered in this order)."""
    return [x for name in (config, *ts.presets) for x in ("--config", name)]


def colocated_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """`python -m benchmarks.colocated ARGS`: one process, every core (no per-rank thread cap)."""
    _, env = job_command(1, *args)
    env.pop("OMP_NUM_THREADS")
    return [sys.executable, "-m", "benchmarks.colocated", *args], env


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
        "trainer_busy_frac": mean("trainer_busy_frac"),
        "inference_busy_frac": mean("inference_busy_frac"),
        "inference_occupancy": statistics.median(occupancy) if occupancy else None,
        "steps_per_s": len(steps) / max(steps[-1]["wall_time_s"], 1e-9),
        "curve": {
            "wall_time_s": [r["wall_time_s"] for r in steps],
            "samples": [r["samples"] for r in steps],
            "reward_mean": [r["reward_mean"] for r in steps],
            "reward_smooth": smooth,
            "ess": [r["ess"] for r in steps],
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
    out: dict[str, list[float]] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("lag_turn/"):
                out.setdefault(k.split("/", 1)[1], []).append(v)
    return {i: statistics.fmean(v) for i, v in sorted(out.items(), key=lambda kv: int(kv[0]))}


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
    turns = sorted({i for r in per_seed for i in r.get("lag_by_turn", {})}, key=int)
    out["lag_by_turn"] = {
        i: statistics.fmean(r["lag_by_turn"][i] for r in per_seed if i in r.get("lag_by_turn", {})) for i in turns
    }
    return out


def overlap_bound(trainer_busy: float, engine_busy: float) -> float:
    """B = (T_gen + T_train) / max(T_gen, T_train) from conventional G=1's busy fractions: the speed-up a perfect
    overlap of its two alternating sides would give (1: one side does all the work; 2: equal sides)."""
    return (trainer_busy + engine_busy) / max(trainer_busy, engine_busy)


def speedups(results: dict[str, dict]) -> None:
    """Add, to every mode in place: `speedup_vs_conventional` (conventional G=1's median time to target / this
    mode's), `speedup_vs_best_conventional` (the fastest conventional G instead), the same per further target, and
    `throughput_vs_conventional` (median optimizer steps per second, a less noisy view of the same effect), and
    with a colocated run `speedup_vs_colocated`."""
    conv = {k: v for k, v in results.items() if k.startswith("conventional")}
    base = results.get("conventional_G1")
    coloc = results.get("colocated")

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num and den else None

    for v in results.values():
        t = v["time_to_target_s"]
        best = min((c["time_to_target_s"] for c in conv.values() if c["time_to_target_s"]), default=None)
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


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def fmt_range(v: float | None, r: list, spec: str = ".1f") -> str:
    return f"{fmt(v, spec)} ({fmt(r[0], spec)}-{fmt(r[1], spec)})"


def table(
    results: dict[str, dict],
    target: float,
    window: int,
    bound: float | None,
    seeds: int,
    engine: str = "",
    metric: str = "",
) -> str:
    """The markdown table: one line of what was measured and the bound, then a row per mode. `metric` describes
    the target's quantity (default: the sampled reward's moving average over `window` steps)."""
    first = next(iter(results.values()))
    targets = list(first["time_to_targets_s"])
    reward_targets = list(first.get("reward_time_to_targets_s", {}))
    head = (
        "| mode | time to target (s) | reached | samples to target | speedup vs conv G=1 | vs best conv | "
        + "".join(f"time / speedup @{t} | " for t in targets if t != str(target))
        + "".join(f"sampled reward @{t}: time / speedup | " for t in reward_targets)
        + ("final accuracy | " if "final_accuracy" in first else "")
        + "final reward | mean ESS | min ESS | lag mean / max | trainer busy | engine busy | engine occupancy | "
        "steps/s (vs conv G=1) |"
    )
    pipe = results.get("pipeline", {}).get("speedup_vs_conventional")
    vs_coloc = results.get("pipeline", {}).get("speedup_vs_colocated")
    lines = [
        f"Median (min-max) over {seeds} seeds per mode{f' ({engine} engine)' if engine else ''}; "
        f"target: {metric or f'sampled reward, moving average over {window} steps'}, "
        f">= {target}. Bound B = {fmt(bound)} (conventional G=1's trainer + engine busy fractions / the larger); "
        f"pipeline reached {fmt(pipe)}x conventional G=1, {fmt(pipe / bound if pipe and bound else None)} B"
        + (f", {fmt(vs_coloc)}x the colocated baseline." if "colocated" in results else "."),
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for name, v in results.items():
        more = "".join(
            f"{fmt_range(v['time_to_targets_s'][t], v['time_to_targets_range'][t])} / "
            f"{fmt(v['speedup_vs_conventional_per_target'][t])} | "
            for t in targets
            if t != str(target)
        )
        more += "".join(
            f"{fmt_range(v['reward_time_to_targets_s'][t], v['reward_time_to_targets_range'][t])} / "
            f"{fmt(v['reward_speedup_vs_conventional_per_target'][t])} | "
            for t in reward_targets
        )
        if "final_accuracy" in v:
            more += f"{fmt(v['final_accuracy'], '.3f')} | "
        lines.append(
            f"| {name} | {fmt_range(v['time_to_target_s'], v['time_to_target_s_range'])} | "
            f"{v['reached_target']}/{v['n_seeds']} | "
            f"{fmt_range(v['samples_to_target'], v['samples_to_target_range'], '.0f')} | "
            f"{fmt(v['speedup_vs_conventional'])} | {fmt(v['speedup_vs_best_conventional'])} | {more}"
            f"{v['final_reward']:.3f} | {v['mean_ess']:.3f} | {v['min_ess']:.3f} | "
            f"{v['mean_lag']:.2f} / {v['max_lag']} | "
            f"{v['trainer_busy_frac']:.2f} | {v['inference_busy_frac']:.2f} | {fmt(v.get('inference_occupancy'))} | "
            f"{v['steps_per_s']:.2f} ({fmt(v['throughput_vs_conventional'])}) |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], target: float, path: Path) -> bool:
    """Held-out accuracy (when measured) and sampled reward against time and samples, one curve per seed; ESS."""
    plt = pyplot()
    if plt is None:
        return False
    has_eval = "eval_curve" in next(iter(results.values()))["seeds"][0]
    panels = (["accuracy"] if has_eval else []) + ["reward_smooth"]
    fig, axes = plt.subplots(len(panels), 3, figsize=(17, 4.6 * len(panels)), squeeze=False)
    ylabel = {"accuracy": "held-out greedy accuracy", "reward_smooth": "sampled reward (moving average)"}
    for i, (name, v) in enumerate(results.items()):
        colour = f"C{i}"
        for k, run in enumerate(v["seeds"]):  # one curve per seed, one colour per mode
            label = name if k == 0 else None
            for row, key in enumerate(panels):
                c = run["eval_curve"] if key == "accuracy" else run["curve"]
                axes[row][0].plot(c["wall_time_s"], c[key], color=colour, lw=0.9, label=label)
                axes[row][1].plot(c["samples"], c[key], color=colour, lw=0.9, label=label)
            ess = run["curve"]["ess"]
            axes[0][2].plot(range(1, len(ess) + 1), ess, color=colour, lw=0.6, label=label)
    for row, key in enumerate(panels):
        for ax, xl in zip(axes[row][:2], ["trainer wall time (s)", "samples"]):
            if row == 0:
                ax.axhline(target, color="grey", ls="--", lw=0.8)
            ax.set_xlabel(xl)
            ax.set_ylabel(ylabel[key])
    axes[0][2].set_xlabel("optimizer step")
    axes[0][2].set_ylabel("ESS")
    for row in range(1, len(panels)):
        axes[row][2].axis("off")
    save_figure(fig, path)
    return True


def main() -> None:
    a = parse_args()
    if a.replot:
        saved = json.loads((a.out / "learning_speed.json").read_text())
        if plot(saved["modes"], saved["settings"]["target"], a.out / "learning_speed.png"):
            print(f"plot: {a.out / 'learning_speed.png'}", flush=True)
        return
    ts = TASK_SETTINGS[a.task]
    a.config = a.config or TASK_CONFIG[a.task]
    default_target, default_more = ts.accuracy_targets if a.metric == "accuracy" else ts.reward_targets
    target = a.target if a.target is not None else default_target
    more_targets = [float(x) for x in (a.more_targets if a.more_targets is not None else default_more).split(",") if x]
    # with held-out accuracy as the metric, the sampled reward's times to its own targets are reported beside it
    reward_targets = sorted({ts.reward_targets[0], *map(float, ts.reward_targets[1].split(","))})
    steps = a.steps or (ts.quick_steps if a.quick else ts.full_steps)
    modes = a.modes or (
        ts.quick_modes
        if a.quick
        else "pipeline,conventional:1,conventional:2,conventional:4,conventional:8,async,colocated"
    )
    eval_size = a.eval_size if a.eval_size is not None else ts.eval_size[0 if a.quick else 1]
    eval_every = a.eval_every or ts.eval_every[0 if a.quick else 1]
    a.out.mkdir(parents=True, exist_ok=True)
    common = [
        *config_args(a.config, ts),
        f"--world.inference_ranks={a.inference_ranks}",
        f"--rl.max_steps={steps}",
        "--eval.every=0",
        "--metrics.log_every=25",
        f"--inference.engine={a.engine or TASK_ENGINE[a.task]}",
        *([f"--loss.name={a.loss}"] if a.loss else []),
        *(["--checkpoint.export_every=" + str(eval_every)] if a.metric == "accuracy" else []),
        *a.extra,
    ]
    # The warm start once, shared by every mode and seed (its folder is reused when it exists).
    t0 = time.time()
    run_job(
        [*common, "--job.stage=warmstart", "--world.inference_ranks=0", f"--job.output_dir={a.out / 'warmstart_run'}"],
        a.out / "warmstart.log",
        a.nproc - a.inference_ranks,
    )
    print(f"warm start ready ({time.time() - t0:.0f} s)", flush=True)
    evaluator, start_accuracy, metric = None, None, ""
    if a.metric == "accuracy":
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))  # evaluation runs between runs, on every core
        job_cfg = load_config(common)
        # exports are evaluated one per core at a time; the warm start here, on every core
        evaluator = Evaluator(job_cfg, eval_size, workers=len(os.sched_getaffinity(0)))
        start_accuracy = evaluator.accuracy(Path(job_cfg.warmstart.path))
        metric = (
            f"held-out greedy accuracy ({len(evaluator.problems)} problems) of the policy exported every "
            f"{eval_every} steps, linear between exports"
        )
        print(f"warm start: held-out greedy accuracy {start_accuracy:.3f} on {len(evaluator.problems)} problems")
        if start_accuracy >= min(target, *more_targets):
            raise SystemExit(
                f"the warm start {job_cfg.warmstart.path} already scores {start_accuracy:.3f} >= the lowest target "
                f"{min(target, *more_targets)}: time to target would be 0 for every mode. Delete the folder (the "
                "preset's warm start stops at a fixed accuracy) or raise --target / --more-targets"
            )
    per_seed: dict[str, list[dict]] = {}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for spec in modes.split(","):
            mode, _, g = spec.partition(":")
            g = g or "1"
            name = f"{mode}_G{g}" if mode == "conventional" else mode
            out = a.out / "runs" / f"{name}_seed{seed}"
            t0 = time.time()
            # a clean folder: an earlier run's checkpoints would be resumed from, its exports evaluated as this run's
            shutil.rmtree(out, ignore_errors=True)
            args = [*common, f"--job.seed={seed}", f"--job.output_dir={out}"]
            if mode == "colocated":
                run_logged(*colocated_command(args), a.out / f"{name}_seed{seed}.log")
            else:
                # conventional takes whole batches (its round is complete before training: parts would only cost)
                whole = ["--rl.waves=1"] if mode == "conventional" else []
                mode_args = [f"--rl.mode={mode}", f"--rl.sync_every={g}", *whole]
                run_job([*args, *mode_args], a.out / f"{name}_seed{seed}.log", a.nproc)
            recs = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
            t_eval = time.time()
            # the exports up to the first at the highest target, and the final policy (the rest would only cost time)
            until = max(target, *more_targets)
            curve = evaluator.curve(out, start_accuracy, until) if evaluator is not None else None
            t_eval = time.time() - t_eval
            r = summarise(recs, target, more_targets, a.window, curve, reward_targets)
            per_seed.setdefault(name, []).append(r)
            print(
                f"{name} seed {seed}: {time.time() - t0:.0f} s in all (evaluation {t_eval:.0f} s), time to target "
                f"{fmt(r['time_to_target_s'], '.1f')} s, final reward {r['final_reward']:.3f}, "
                + (f"final accuracy {r['final_accuracy']:.3f}, " if curve else "")
                + f"mean ESS {r['mean_ess']:.3f}, steps/s {r['steps_per_s']:.2f}",
                flush=True,
            )
    if evaluator is not None:
        evaluator.close()
    results = {name: aggregate(runs) for name, runs in per_seed.items()}
    speedups(results)
    conv1 = results.get("conventional_G1")
    bound = overlap_bound(conv1["trainer_busy_frac"], conv1["inference_busy_frac"]) if conv1 else None
    md = table(results, target, a.window, bound, a.seeds, a.engine or TASK_ENGINE[a.task], metric)
    by_turn = {name: v["lag_by_turn"] for name, v in results.items() if v.get("lag_by_turn")}
    if by_turn:  # a multi-turn task: how stale each turn index's tokens were
        turns = sorted({i for v in by_turn.values() for i in v}, key=int)
        md += "\n\nMean lag by model turn index (versions between the trained weights and a turn's tokens):\n\n"
        md += "| mode | " + " | ".join(f"turn {i}" for i in turns) + " |\n|---|" + "---|" * len(turns) + "\n"
        md += "\n".join(
            f"| {name} | " + " | ".join(f"{v[i]:.2f}" if i in v else "-" for i in turns) + " |"
            for name, v in by_turn.items()
        )
    print(md, flush=True)
    meta = {
        "task": a.task,
        "config": a.config,
        "steps": steps,
        "seeds": a.seeds,
        "first_seed": a.first_seed,
        "target": target,
        "more_targets": more_targets,
        "window": a.window,
        "metric": a.metric,
        "eval_size": eval_size if evaluator else None,
        "eval_every": eval_every if evaluator else None,
        "start_accuracy": start_accuracy,
        "reward_targets": reward_targets if evaluator else None,
        "nproc": a.nproc,
        "inference_ranks": a.inference_ranks,
        "engine": a.engine or TASK_ENGINE[a.task],
        "loss": a.loss,
        "extra": a.extra,
        "cpu_count": os.cpu_count(),
        "bound": bound,
    }
    (a.out / "learning_speed.json").write_text(
        json.dumps({"settings": meta, "bound": bound, "modes": results}, indent=1)
    )
    (a.out / "learning_speed.md").write_text(md + "\n")
    if plot(results, target, a.out / "learning_speed.png"):
        print(f"plot: {a.out / 'learning_speed.png'}", flush=True)
    print(f"JSON: {a.out / 'learning_speed.json'}; TensorBoard: tensorboard --logdir {a.out / 'runs'}", flush=True)


if __name__ == "__main__":
    main()
