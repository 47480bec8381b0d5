"""Learning speed of the RL modes side by side: PipelineRL vs conventional (G = 1 and larger) vs async, over seeds.

Every mode runs the same job (`train_configs/arithmetic.toml` unless --config), on the same hardware split
(--nproc ranks, --inference-ranks of them engines), from the same warm start, with the same samples per optimizer
step, once per seed (`job.seed`: problems and sampling); only `rl.mode` and `rl.sync_every` (G) change. Runs go one
after another, seed by seed (every mode of seed 0, then of seed 1, ...), so a drift of the machine hits all modes.

Reports per mode, as the median and range over seeds: time to target at the main and further targets (the trainer's
wall clock, engine start-up excluded), samples to target, final accuracy and reward, ESS (mean, and the minimum of
any step), mean / max lag, busy fractions, engine occupancy (median over steps), optimizer steps per second;
`speedup_vs_conventional` = conventional G=1's median time to the target / this mode's,
`speedup_vs_best_conventional` against the fastest conventional G of those run (`best_conventional`). The bound
B = (T_gen + T_train) / max(T_gen, T_train) comes from conventional G=1's busy fractions in the same run (its two
sides take turns, so overlapping them perfectly would take max instead of the sum). Writes `learning_speed.json`,
`learning_speed.md`, `learning_speed.png` (accuracy and reward vs time and vs samples, one curve per seed; ESS, raw
and truncated, vs step) under --out;
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
  python -m benchmarks.learning_speed --task long_tail          # the paper's long-generation regime (countdown,
                                                               # 20..1,025 tokens, heavy-tailed); --task
                                                               # long_uniform: its uniform twin (same mean)

The long-generation tasks (`long_tail`, `long_uniform`: the preset is the whole job config) dump every step's
rollouts (`metrics.rollouts_every = 1`); each run's summary then holds the exact token-lag histogram and its p50 /
p90 / max (`benchmarks/token_lag.py`), and the report a second table (token lag, raw and truncated ESS, busy and
blocked fractions of both sides, the mean lag by tenth of the completion) and `learning_speed_lag.png` (the
token-lag histogram per mode, log y). `python -m benchmarks.long_regime` sets the two presets' speed-ups side by side.
Task settings: `benchmarks/learning_speed_tasks.py`; statistics: `learning_speed_stats.py`; figures:
`learning_speed_plots.py`.

Mode `colocated` is the single-process baseline `python -m benchmarks.colocated` (`rl.mode = "colocated"`: generate
with every core, then train with every core; same config, data, step and metrics); `speedup_vs_colocated` compares
against it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import ROOT, run_job, run_logged
from benchmarks.heldout import Evaluator
from benchmarks.learning_speed_claims import claims, claims_table
from benchmarks.learning_speed_plots import plot, plot_lag
from benchmarks.learning_speed_stats import aggregate, overlap_bound, speedups, summarise
from benchmarks.learning_speed_tasks import TASK_CONFIG, TASK_ENGINE, TASK_SETTINGS, RunSpec, parse_mode, task_args
from benchmarks.token_lag import histogram, lag_summary, read_dumps
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
        "--resummarise",
        action="store_true",
        help="no runs: recompute --out's tables, JSON and plots from its runs' step metrics and the held-out curves "
        "its JSON holds (after a change to the statistics)",
    )
    p.add_argument(
        "--order",
        choices=["random", "fixed"],
        default="random",
        help="the order of the modes within each seed: drawn from the seed (default), or as --modes lists them",
    )
    p.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="hold an exclusive flock on this file through each seed's runs and their evaluations (a machine shared "
        "with other jobs: they go between two seeds, never during a timed run)",
    )
    p.add_argument(
        "--summary",
        type=Path,
        default=None,
        help="also write the runs' summaries to this JSON (small; what --report regenerates every table and plot from)",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="no runs: the tables, JSON and plots again under --out from a --summary file, bit for bit",
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="only draw --out's learning_speed.png from its learning_speed.json (e.g. after installing matplotlib)",
    )
    return p.parse_args()


def colocated_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """`python -m benchmarks.colocated ARGS`: one process, every core (no per-rank thread cap)."""
    _, env = job_command(1, *args)
    env.pop("OMP_NUM_THREADS")
    return [sys.executable, "-m", "benchmarks.colocated", *args], env


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
    # the pipeline run (the fastest, where it ran on several engines)
    pipes = [k for k in results if k.split("@")[0] == "pipeline"]
    pname = min(pipes, key=lambda k: results[k]["time_to_target_s"] or float("inf"), default=None)
    pipe = results[pname].get("speedup_vs_conventional") if pname else None
    best = first.get("best_conventional")
    vs_coloc = results[pname].get("speedup_vs_colocated") if pname else None
    lines = [
        f"Median (min-max) over {seeds} seeds per mode{f' ({engine} engine)' if engine else ''}; "
        f"target: {metric or f'sampled reward, moving average over {window} steps'}, "
        f">= {target}. Bound B = {fmt(bound)} (conventional G=1's trainer + engine busy fractions / the larger); "
        f"{pname or 'pipeline'} reached {fmt(pipe)}x conventional G=1, "
        f"{fmt(pipe / bound if pipe and bound else None)} B"
        + (f", {fmt(vs_coloc)}x the colocated baseline." if "colocated" in results else ".")
        + (f" Best conventional G (the fastest of those run): {best}." if best else ""),
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


def lag_table(results: dict[str, dict]) -> str:
    """The long-generation view, where the runs dumped their rollouts: the whole run's token lag p50 / p90 / max
    (every seed's tokens together), raw and truncated ESS, both sides' busy and blocked fractions, and the mean lag
    of each tenth of the completion (`lag_pos/<i>`: 1 holds its first tokens). Empty when no mode has dumps."""
    if not any("token_lag" in v for v in results.values()):
        return ""
    tenths = sorted({i for v in results.values() for i in v.get("lag_by_tenth", {})}, key=int)
    head = (
        "| mode | token lag p50 / p90 / max | tokens | ESS mean / min | truncated ESS mean / min | "
        "trainer busy / push blocked | engine busy / send blocked |" + "".join(f" lag, tenth {i} |" for i in tenths)
    )
    lines = ["", "", "Token lag over the whole run (rollout dumps), ESS, busy and blocked fractions:", "", head]
    lines.append("|" + "---|" * (head.count("|") - 1))
    for name, v in results.items():
        lag = v.get("token_lag", {})
        lines.append(
            f"| {name} | {lag.get('p50', 'n/a')} / {lag.get('p90', 'n/a')} / {lag.get('max', 'n/a')} | "
            f"{lag.get('tokens', 0)} | {v['mean_ess']:.3f} / {v['min_ess']:.3f} | "
            f"{fmt(v.get('mean_ess_truncated'), '.3f')} / {fmt(v.get('min_ess_truncated'), '.3f')} | "
            f"{v['trainer_busy_frac']:.2f} / {fmt(v.get('trainer_push_blocked_frac'))} | "
            f"{v['inference_busy_frac']:.2f} / {fmt(v.get('inference_send_blocked_frac'))} |"
            + "".join(f" {fmt(v.get('lag_by_tenth', {}).get(i))} |" for i in tenths)
        )
    return "\n".join(lines)


@contextlib.contextmanager
def cpu_lock(path: Path | None) -> Iterator[None]:
    """An exclusive flock on `path` for the block (nothing without a path). Linux serves flock's waiters in arrival
    order: a benchmark that must not wait behind other jobs between its seeds holds one lock around the whole command
    instead (`flock FILE python -m benchmarks.learning_speed ...`)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def relative_targets(start: float, fractions: list[float]) -> list[float]:
    """Targets that close the share f of the warm start's remaining error: start + f (1 - start), to 3 decimals."""
    if not all(0 < f < 1 for f in fractions):
        raise SystemExit(f"relative targets must be fractions in (0, 1) of the remaining error, got {fractions}")
    return [round(start + f * (1 - start), 3) for f in fractions]


def mode_order(specs: list[RunSpec], seed: int, order: str) -> list[RunSpec]:
    """The modes of one seed in the order they run: drawn from the seed (`random`), or as given."""
    out = list(specs)
    if order == "random":
        random.Random(seed).shuffle(out)
    return out


def run_mode(spec: RunSpec, common: list[str], engine: str, seed: int, out: Path, log: Path, nproc: int) -> None:
    """One run of `spec` into `out` (a clean folder: an earlier run's checkpoints would be resumed from)."""
    shutil.rmtree(out, ignore_errors=True)
    args = [*common, f"--inference.engine={engine}", f"--job.seed={seed}", f"--job.output_dir={out}"]
    if spec.mode == "colocated":
        run_logged(*colocated_command(args), log)
        return
    # conventional takes whole batches (its round is complete before training: parts would only cost)
    whole = ["--rl.waves=1"] if spec.mode == "conventional" else []
    run_job([*args, f"--rl.mode={spec.mode}", f"--rl.sync_every={spec.k}", *whole], log, nproc)


def main() -> None:
    a = parse_args()
    if a.replot:
        saved = json.loads((a.out / "learning_speed.json").read_text())
        if plot(saved["modes"], saved["settings"]["target"], a.out / "learning_speed.png"):
            print(f"plot: {a.out / 'learning_speed.png'}", flush=True)
        if plot_lag(saved["modes"], a.out / "learning_speed_lag.png"):
            print(f"token-lag histogram: {a.out / 'learning_speed_lag.png'}", flush=True)
        return
    if a.resummarise:
        resummarise(a.out)
        return
    if a.report:
        report_from_summary(a.report, a.out)
        return
    ts = TASK_SETTINGS[a.task]
    a.config = a.config or TASK_CONFIG[a.task]
    default_target, default_more = ts.accuracy_targets if a.metric == "accuracy" else ts.reward_targets
    target = a.target if a.target is not None else default_target
    more_targets = [float(x) for x in (a.more_targets if a.more_targets is not None else default_more).split(",") if x]
    # targets stated relative to the warm start's own held-out accuracy a: a + f (1 - a) for the task's fractions f
    # (unless given on the command line): one command gives comparable tables where warm starts land differently
    relative = ts.relative_targets and a.metric == "accuracy" and a.target is None and a.more_targets is None
    # with held-out accuracy as the metric, the sampled reward's times to its own targets are reported beside it
    reward_targets = sorted({ts.reward_targets[0], *map(float, ts.reward_targets[1].split(","))})
    steps = a.steps or (ts.quick_steps if a.quick else ts.full_steps)
    specs = [parse_mode(x) for x in (a.modes or (ts.quick_modes if a.quick else ts.full_modes)).split(",")]
    default_engine = a.engine or TASK_ENGINE[a.task]
    eval_size = a.eval_size if a.eval_size is not None else ts.eval_size[0 if a.quick else 1]
    eval_every = a.eval_every or ts.eval_every[0 if a.quick else 1]
    a.out.mkdir(parents=True, exist_ok=True)
    common = [
        *task_args(a.config, ts),
        f"--world.inference_ranks={a.inference_ranks}",
        f"--rl.max_steps={steps}",
        "--eval.every=0",
        "--metrics.log_every=25",
        *([f"--loss.name={a.loss}"] if a.loss else []),
        *(["--checkpoint.export_every=" + str(eval_every)] if a.metric == "accuracy" else []),
        *a.extra,
    ]
    # The warm start once, shared by every mode and seed (its folder is reused when it exists).
    t0 = time.time()
    with cpu_lock(a.lock):
        run_job(
            [
                *common,
                "--job.stage=warmstart",
                "--world.inference_ranks=0",
                f"--job.output_dir={a.out / 'warmstart_run'}",
            ],
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
        with cpu_lock(a.lock):
            start_accuracy = evaluator.accuracy(Path(job_cfg.warmstart.path))
        if relative:
            target, *more_targets = relative_targets(start_accuracy, [target, *more_targets])
        metric = (
            f"held-out greedy accuracy ({len(evaluator.problems)} problems) of the policy exported every "
            f"{eval_every} steps, linear between exports"
            + (
                f"; targets a + f (1 - a): the warm start's a = {start_accuracy:.3f}, f = {default_target} "
                f"(further: {default_more})"
                if relative
                else ""
            )
        )
        print(f"warm start: held-out greedy accuracy {start_accuracy:.3f} on {len(evaluator.problems)} problems")
        if start_accuracy >= min(target, *more_targets):
            raise SystemExit(
                f"the warm start {job_cfg.warmstart.path} already scores {start_accuracy:.3f} >= the lowest target "
                f"{min(target, *more_targets)}: time to target would be 0 for every mode. Delete the folder (the "
                "preset's warm start stops at a fixed accuracy) or raise --target / --more-targets"
            )
    per_seed: dict[str, list[dict]] = {spec.name: [] for spec in specs}
    orders: dict[str, list[str]] = {}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        order = mode_order(specs, seed, a.order)
        orders[str(seed)] = [spec.name for spec in order]
        with cpu_lock(a.lock):  # a seed's runs side by side on a quiet machine
            for spec in order:
                name = spec.name
                out = a.out / "runs" / f"{name}_seed{seed}"
                t0 = time.time()
                engine = "reference" if spec.mode == "colocated" else spec.engine or default_engine
                run_mode(spec, common, engine, seed, out, a.out / f"{name}_seed{seed}.log", a.nproc)
                recs = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
                t_eval = time.time()
                # the exports up to the first at the highest target, and the final policy (the rest would cost)
                until = max(target, *more_targets)
                curve = evaluator.curve(out, start_accuracy, until) if evaluator is not None else None
                t_eval = time.time() - t_eval
                r = summarise(recs, target, more_targets, a.window, curve, reward_targets)
                hist = histogram(read_dumps(out))
                if hist:  # the run's exact token lags (metrics.rollouts_every = 1: every step's batch)
                    r["token_lag"] = lag_summary(hist)
                per_seed[name].append(r)
                # after every run: a run that fails later keeps what the earlier ones measured
                write_summary(a.summary or a.out / "summary.json", per_seed, {"partial": True, "orders": orders})
                print(
                    f"{name} seed {seed}: {time.time() - t0:.0f} s in all (evaluation {t_eval:.0f} s), time to "
                    f"target {fmt(r['time_to_target_s'], '.1f')} s, final reward {r['final_reward']:.3f}, "
                    + (f"final accuracy {r['final_accuracy']:.3f}, " if curve else "")
                    + f"mean ESS {r['mean_ess']:.3f}, steps/s {r['steps_per_s']:.2f}",
                    flush=True,
                )
    if evaluator is not None:
        evaluator.close()
    meta = {
        "task": a.task,
        "config": a.config,
        "steps": steps,
        "seeds": a.seeds,
        "first_seed": a.first_seed,
        "target": target,
        "more_targets": more_targets,
        "relative_targets": relative,
        "window": a.window,
        "metric": a.metric,
        "eval_size": eval_size if evaluator else None,
        "eval_every": eval_every if evaluator else None,
        "start_accuracy": start_accuracy,
        "reward_targets": reward_targets if evaluator else None,
        "nproc": a.nproc,
        "inference_ranks": a.inference_ranks,
        "engine": default_engine,
        "loss": a.loss,
        "metric_text": metric,
        "extra": a.extra,
        "cpu_count": os.cpu_count(),
        "order": a.order,
        "orders": orders,
        "command": "python -m benchmarks.learning_speed " + " ".join(sys.argv[1:]),
    }
    summary = a.summary or a.out / "summary.json"
    write_summary(summary, per_seed, meta)
    report_from_summary(summary, a.out)


def write_summary(path: Path, per_seed: dict[str, list[dict]], meta: dict) -> None:
    """The runs' summaries (per mode, per seed: what `summarise` made of each run) and the settings: everything the
    report is computed from, small enough to keep in the repository."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": meta, "runs": per_seed}, indent=1) + "\n")


def report_from_summary(path: Path, out: Path) -> None:
    """Every table, JSON and plot of the report under `out`, computed from a `write_summary` file alone."""
    saved = json.loads(path.read_text())
    results = {name: aggregate(runs) for name, runs in saved["runs"].items() if runs}
    out.mkdir(parents=True, exist_ok=True)
    write_report(out, results, saved["settings"])


def write_report(out: Path, results: dict, meta: dict) -> None:
    """Speed-ups, the bound, the tables, JSON and plots of a run's `results` (mode -> `aggregate`) under `out`."""
    speedups(results)
    conv1 = next((v for k, v in results.items() if k == "conventional_G1" or k.startswith("conventional_G1@")), None)
    bound = overlap_bound(conv1["trainer_busy_frac"], conv1["inference_busy_frac"]) if conv1 else None
    meta = {**meta, "bound": bound}
    target, window, metric = meta["target"], meta["window"], meta["metric_text"]
    md = table(results, target, window, bound, meta["seeds"], meta["engine"], metric)
    by_turn = {name: v["lag_by_turn"] for name, v in results.items() if v.get("lag_by_turn")}
    if by_turn:  # a multi-turn task: how stale each turn index's tokens were
        turns = sorted({i for v in by_turn.values() for i in v}, key=int)
        md += "\n\nMean lag by model turn index (versions between the trained weights and a turn's tokens):\n\n"
        md += "| mode | " + " | ".join(f"turn {i}" for i in turns) + " |\n|---|" + "---|" * len(turns) + "\n"
        md += "\n".join(
            f"| {name} | " + " | ".join(f"{v[i]:.2f}" if i in v else "-" for i in turns) + " |"
            for name, v in by_turn.items()
        )
    md += lag_table(results)
    if meta["seeds"] >= 2:
        md += "\n\n" + claims_table(claims(results, meta["engine"]), meta["seeds"])
    print(md, flush=True)
    (out / "learning_speed.json").write_text(json.dumps({"settings": meta, "bound": bound, "modes": results}, indent=1))
    (out / "learning_speed.md").write_text(md + "\n")
    if plot(results, target, out / "learning_speed.png"):
        print(f"plot: {out / 'learning_speed.png'}", flush=True)
    if plot_lag(results, out / "learning_speed_lag.png"):
        print(f"token-lag histogram: {out / 'learning_speed_lag.png'}", flush=True)
    print(f"JSON: {out / 'learning_speed.json'}; TensorBoard: tensorboard --logdir {out / 'runs'}", flush=True)


def resummarise(out: Path) -> None:
    """Every run's summary again from its step metrics (`runs/<mode>_seed<k>/rl/metrics.jsonl`), with the held-out
    curve and token-lag histogram its saved summary holds (evaluating the exports again would cost minutes and give
    the same numbers), then the report."""
    saved = json.loads((out / "learning_speed.json").read_text())
    meta = saved["settings"]
    more, rewards = meta["more_targets"], meta.get("reward_targets") or []
    results = {}
    for name, mode in saved["modes"].items():
        runs = []
        for k, old in enumerate(mode["seeds"]):
            folder = out / "runs" / f"{name}_seed{meta['first_seed'] + k}"
            recs = [json.loads(x) for x in (folder / "rl" / "metrics.jsonl").read_text().splitlines()]
            r = summarise(recs, meta["target"], more, meta["window"], old.get("eval_curve"), rewards)
            if "token_lag" in old:
                r["token_lag"] = old["token_lag"]
            runs.append(r)
        results[name] = aggregate(runs)
    if "metric_text" not in meta:  # a JSON older than this key: the sentence the run printed is not kept
        meta["metric_text"] = (
            f"held-out greedy accuracy ({meta['eval_size']} problems) of the policy exported every "
            f"{meta['eval_every']} steps, linear between exports"
            if meta["eval_size"]
            else ""
        )
    write_report(out, results, meta)


if __name__ == "__main__":
    main()
