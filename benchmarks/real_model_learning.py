"""A real pretrained model learning on this machine: SmolLM2-135M-Instruct on word problems, pipeline vs
conventional G = 1, held-out greedy accuracy of exported policies against wall time.

    python scripts/convert_smollm2.py
    python -m benchmarks.real_model_learning --runs pipeline:0,pipeline:1,conventional:1
    python -m benchmarks.real_model_learning --runs pipeline:1 --steps 30 --tag kv0 --no-eval \\
        --extra=--inference.kv_max_age=0
    python -m benchmarks.real_model_learning --runs pipeline:1 --tag lora_r16 --extra=--config=lora
    python -m benchmarks.real_model_learning --summarise --runs pipeline:1:full,pipeline:1:lora_r16,pipeline:1:lora_r1

Each run is one job of the preset (`--config`, default `word_problems_smollm2_cpu`: 1 vLLM engine + 1 trainer, one
core each) into OUT/<mode>_seed<k>[_<tag>]/ with `job.seed = k`, `--steps` optimizer steps, no in-run evaluation,
and its policy exported every --export-every steps. Mode `conventional` is G = 1 (`rl.sync_every = 1`, whole
batches): generate, then train, then load, in turn. A run whose `rl/metrics.jsonl` already holds its last step is
not run again (so runs can be added one at a time, and a finished run re-summarised).

After the runs, every export and the start model are evaluated by `scripts/task_accuracy.py` (greedy, the first --size
held-out problems, the job's vLLM engine on one core; two evaluations at a time, one per core, outside the runs'
time): OUT/start.json and OUT/<run>/eval/step-N.json. The table gives, per run: accuracy at each export with its
wall time (the trainer's clock from its first step), time to --target (linear between exports), and over the run
the ESS, lag, engine/trainer mismatch on lag-0 tokens, outcomes, completion lengths, update pauses and the two
sides' speeds. Writes real_model_learning.{json,md,png} under --out (the plot: accuracy vs wall time, completion
length and truncation vs step, ESS vs step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, ROOT, markdown_table, pyplot, read_metrics, report, run_job, save_figure
from benchmarks.heldout import crossing
from pipelinerl_fsdp.checkpoint_layout import exported_policies


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="word_problems_smollm2_cpu")
    p.add_argument("--runs", default="pipeline:0,pipeline:1,conventional:1", help="MODE:SEED[:TAG],...")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--export-every", type=int, default=25)
    p.add_argument("--size", type=int, default=300, help="held-out problems per evaluation")
    p.add_argument("--gain", type=float, default=0.10, help="target = start accuracy + gain")
    p.add_argument("--tag", default="", help="suffix of the run folders (a variant of the same mode and seed)")
    p.add_argument(
        "--extra", action="append", default=[], help="one more --section.key=value for every run; repeatable"
    )
    p.add_argument("--no-eval", action="store_true", help="run only; no accuracy (e.g. a short throughput run)")
    p.add_argument("--summarise", action="store_true", help="no runs, no evaluations: tables and plot only")
    p.add_argument("--out", type=Path, default=RESULTS / "real_model_learning")
    return p.parse_args()


def run_name(mode: str, seed: int, tag: str) -> str:
    return f"{mode}_seed{seed}" + (f"_{tag}" if tag else "")


def mode_args(mode: str) -> list[str]:
    if mode == "pipeline":
        return ["--rl.mode=pipeline"]
    if mode == "conventional":
        return ["--rl.mode=conventional", "--rl.sync_every=1", "--rl.waves=1"]
    raise SystemExit(f"--runs: unknown mode {mode!r} (pipeline or conventional)")


def finished(folder: Path, steps: int) -> bool:
    path = folder / "rl" / "metrics.jsonl"
    return path.exists() and any(r.get("step") == steps for r in read_metrics(path))


def evaluate(a: argparse.Namespace, model: Path | None, out: Path, core: int) -> None:
    """`scripts.task_accuracy` on `model` (the config's own when None) into `out`, on one core; skipped when done."""
    if out.exists():
        return
    cmd = [sys.executable, "-m", "scripts.task_accuracy", "--config", a.config]
    cmd += ["--size", str(a.size), "--core", str(core), "--out", str(out)]
    if model is not None:
        cmd += ["--", f"--model.path={model}"]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"evaluation failed: {' '.join(cmd)}; log {log}:\n{log.read_text()[-3000:]}")


def evaluate_all(a: argparse.Namespace, runs: list[tuple[str, int, str]]) -> None:
    jobs: list[tuple[Path | None, Path]] = [(None, a.out / "start.json")]
    for mode, seed, tag in runs:
        folder = a.out / run_name(mode, seed, tag)
        for step, path in exported_policies(folder, a.steps):
            jobs.append((path, folder / "eval" / f"step-{step}.json"))
    # two at a time, one per core (each is a one-thread vLLM engine bound to its core)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ij: evaluate(a, *ij[1], core=ij[0] % 2), enumerate(jobs)))


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.mean(xs) if xs else float("nan")


def summarise_run(folder: Path, start: dict | None, target: float | None) -> dict[str, Any]:
    recs = [r for r in read_metrics(folder / "rl" / "metrics.jsonl") if "ess" in r]
    by_step = {r["step"]: r for r in recs}
    curve: list[dict[str, Any]] = []
    if start is not None:
        keep = {k: start[k] for k in ("accuracy", "truncated", "completion_tokens_mean")}
        curve.append({"step": 0, "wall_min": 0.0, **keep})
    for path in sorted((folder / "eval").glob("step-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        step = int(path.stem.split("-")[1])
        row = json.loads(path.read_text())["row"]
        wall = by_step[step]["wall_time_s"] / 60 if step in by_step else float("nan")
        keep = {k: row[k] for k in ("accuracy", "truncated", "completion_tokens_mean")}
        curve.append({"step": step, "wall_min": round(wall, 2), **keep})
    to_target = None
    if target is not None and len(curve) > 1:
        to_target = crossing([c["wall_min"] for c in curve], [c["accuracy"] for c in curve], target)

    def quarters(key: str, digits: int) -> list[float]:
        q = max(len(recs) // 4, 1)
        return [round(mean([r.get(key, float("nan")) for r in recs[i : i + q]]), digits) for i in range(0, 4 * q, q)]

    pauses = [r["update_pause_ms"] for r in recs if r.get("update_pause_ms", 0) > 0]
    return {
        "steps": len(recs),
        "wall_min": round(recs[-1]["wall_time_s"] / 60, 2),
        "curve": curve,
        "final_accuracy": curve[-1]["accuracy"] if len(curve) > 1 else None,
        "to_target_min": None if to_target is None else round(to_target, 2),
        "ess_mean": mean([r["ess"] for r in recs]),
        "ess_min": min(r["ess"] for r in recs),
        "lag_mean": mean([r["lag_mean"] for r in recs]),
        "lag_max": max(r["lag_max"] for r in recs),
        "mismatch_kl_mean": mean([r["mismatch_kl"] for r in recs]),
        "mismatch_abs_log_ratio_mean": mean([r["mismatch_abs_log_ratio"] for r in recs]),
        "reward_mean": mean([r["reward_mean"] for r in recs]),
        # outcomes and completion lengths of the sampled (trained) completions, by quarter of the run
        "correct_frac_by_quarter": quarters("outcome/correct", 3),
        "truncated_frac_by_quarter": quarters("truncated_frac", 3),
        "completion_len_by_quarter": quarters("completion_len", 1),
        "update_pause_ms_median": median(pauses),
        # bytes of one in-flight update (absent from runs before the metric existed: NaN)
        "push_mb_median": median([r["push_mb"] for r in recs if r.get("push_mb", 0) > 0] or [float("nan")]),
        "gen_tokens_per_busy_s": median([r["gen_tokens_per_busy_s"] for r in recs]),
        "gen_tokens_per_s": median([r["gen_tokens_per_s"] for r in recs]),
        "train_tokens_per_s": median([r["train_tokens_per_s"] for r in recs]),
        "steps_per_min": round(len(recs) / (recs[-1]["wall_time_s"] / 60), 2),
        "trainer_busy_frac": median([r["trainer_busy_frac"] for r in recs]),
        "inference_busy_frac": median([r["inference_busy_frac"] for r in recs]),
        "per_step": [
            {
                k: r.get(k)
                for k in ("step", "wall_time_s", "ess", "completion_len", "truncated_frac", "reward_mean", "lag_mean")
            }
            for r in recs
        ],  # fmt: skip
    }


def plot(results: dict[str, dict], target: float | None, out: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, r in results.items():
        c = r["curve"]
        if len(c) > 1:
            ax[0].plot([p["wall_min"] for p in c], [p["accuracy"] for p in c], "o-", label=name)
        steps = [p["step"] for p in r["per_step"]]
        ax[1].plot(steps, [p["completion_len"] for p in r["per_step"]], label=f"{name}: completion tokens")
        ax[2].plot(steps, [p["ess"] for p in r["per_step"]], label=name)
    if target is not None:
        ax[0].axhline(target, ls="--", c="grey", lw=1, label=f"target {target:.3f}")
    ax[0].set(xlabel="wall time (min, trainer's clock)", ylabel="held-out greedy accuracy", title="accuracy")
    ax[1].set(xlabel="optimizer step", ylabel="mean completion tokens (sampled)", title="completion length")
    ax[2].set(xlabel="optimizer step", ylabel="ESS (raw importance weights)", title="ESS")
    save_figure(fig, out)
    return True


def main() -> None:
    a = parse_args()
    runs = []
    for spec in a.runs.split(","):  # MODE:SEED, or MODE:SEED:TAG (a tag of its own, e.g. to summarise variants)
        mode, seed, tag = (spec.split(":") + ["", ""])[:3]
        mode_args(mode)
        runs.append((mode, int(seed or 0), tag or a.tag))
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.summarise:
        for mode, seed, tag in runs:
            folder = a.out / run_name(mode, seed, tag)
            if finished(folder, a.steps):
                print(f"{folder.name}: done before, not run again", flush=True)
                continue
            print(f"{folder.name}: running {a.steps} steps", flush=True)
            args = ["--config", a.config, f"--job.seed={seed}", f"--job.output_dir={folder}",
                    f"--rl.max_steps={a.steps}", "--eval.every=0", "--eval.at_start=false",
                    f"--checkpoint.export_every={a.export_every}", *mode_args(mode), *a.extra]  # fmt: skip
            run_job(args, a.out / f"{folder.name}.log", nproc=2)
        if not a.no_eval:
            evaluate_all(a, runs)
    start_path = a.out / "start.json"
    start = json.loads(start_path.read_text())["row"] if start_path.exists() else None
    target = None if start is None else round(start["accuracy"] + a.gain, 3)
    results = {}
    for mode, seed, tag in runs:
        folder = a.out / run_name(mode, seed, tag)
        if (folder / "rl" / "metrics.jsonl").exists():
            results[folder.name] = summarise_run(folder, start, target)
    columns = ["run", "steps", "wall min", "start", "final", "min to target", "ESS mean (min)", "lag mean (max)",
               "mismatch |log r| lag 0", "correct (quarters)", "truncated (quarters)", "completion tokens (quarters)",
               "update pause ms", "push MB", "gen tok/busy s", "train tok/s", "steps/min"]  # fmt: skip
    rows = [
        [
            name,
            r["steps"],
            r["wall_min"],
            None if start is None else start["accuracy"],
            r["final_accuracy"],
            r["to_target_min"],
            f"{r['ess_mean']:.3f} ({r['ess_min']:.3f})",
            f"{r['lag_mean']:.2f} ({r['lag_max']})",
            f"{r['mismatch_abs_log_ratio_mean']:.2g}",
            r["correct_frac_by_quarter"],
            r["truncated_frac_by_quarter"],
            r["completion_len_by_quarter"],
            round(r["update_pause_ms_median"]),
            round(r["push_mb_median"], 2),
            round(r["gen_tokens_per_busy_s"], 1),
            round(r["train_tokens_per_s"], 1),
            r["steps_per_min"],
        ]  # fmt: skip
        for name, r in results.items()
    ]
    curves = [
        [name, p["step"], p["wall_min"], p["accuracy"], p["truncated"], p["completion_tokens_mean"]]
        for name, r in results.items()
        for p in r["curve"]
    ]
    print(markdown_table(["run", "step", "wall min", "accuracy", "truncated", "completion tokens"], curves))
    title = f"{a.config}: held-out greedy accuracy ({a.size} problems), target {target}"
    report(a.out / "real_model_learning.json", title, columns, rows,
           {"start": start, "target": target, "runs": results})  # fmt: skip
    md = a.out / "real_model_learning.md"
    md.write_text(md.read_text() + "\n" + markdown_table(["run", "step", "wall min", "accuracy", "truncated",
                                                           "completion tokens"], curves) + "\n")  # fmt: skip
    if plot(results, target, a.out / "real_model_learning.png"):
        print(f"plot: {a.out / 'real_model_learning.png'}", flush=True)


if __name__ == "__main__":
    main()
