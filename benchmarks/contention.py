"""Do generation and training fight for the cores? The default CPU job's trainer step (`train_step_s`: the batch
in hand to the weights pushed) in pipeline mode, where the engine generates while the trainer trains, against
conventional mode with one batch per round (G = 1), where the engine idles while the trainer trains, each with
and without `job.bind_cores`. Without contention the two modes' steps take the same time.

    python -m benchmarks.contention [--runs 2] [--steps 60] [--skip 10] [--out benchmarks/results/contention] \
        [-- extra job overrides, e.g. --model.path=outputs/warmstart/addition-debug]

Per run: the median `train_step_s` over the steps after `--skip` (start-up excluded); runs interleaved so that a
drift of the machine hits every setting alike. Prints a table (median and range over runs, and the ratio of
pipeline to conventional per binding setting); writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, read_metrics, report, run_job

SETTINGS = {
    ("pipeline", True): ["--rl.mode=pipeline", "--job.bind_cores=true"],
    ("conventional", True): ["--rl.mode=conventional", "--rl.sync_every=1", "--job.bind_cores=true"],
    ("pipeline", False): ["--rl.mode=pipeline", "--job.bind_cores=false"],
    ("conventional", False): ["--rl.mode=conventional", "--rl.sync_every=1", "--job.bind_cores=false"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="arithmetic")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "contention")
    p.add_argument("job_args", nargs="*", help="overrides for the job (after --)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            for (mode, bound), extra in SETTINGS.items():
                key = f"{mode}, bind_cores={str(bound).lower()}"
                out = Path(tmp) / f"{mode}-{bound}-{i}"
                args = [
                    "--config",
                    a.config,
                    f"--job.output_dir={out}",
                    f"--rl.max_steps={a.steps}",
                    "--metrics.log_every=1",
                    "--eval.every=0",
                    "--checkpoint.resume=off",
                    *extra,
                    *a.job_args,
                ]
                run_job(args, Path(tmp) / "log.txt", nproc=2)
                recs = [r for r in read_metrics(out / "rl" / "metrics.jsonl") if r["step"] > a.skip]
                run = {
                    "train_step_s": statistics.median(r["train_step_s"] for r in recs),
                    "push_s": statistics.median(r["push_s"] for r in recs),
                    "compute_s": statistics.median(r["train_step_s"] - r["push_s"] for r in recs),
                    "trainer_busy_frac": statistics.fmean(r["trainer_busy_frac"] for r in recs),
                    "inference_busy_frac": statistics.fmean(r["inference_busy_frac"] for r in recs),
                    "wall_s": recs[-1]["wall_time_s"],
                }
                runs.setdefault(key, []).append(run)
                print(
                    f"{key} run {i}: step {run['train_step_s'] * 1000:.0f} ms, of which push "
                    f"{run['push_s'] * 1000:.0f} ms",
                    flush=True,
                )

    def med(key: str, part: str) -> float:
        return statistics.median(r[part] for r in runs[key])

    print(f"\ntrainer step (median of per-run medians, steps {a.skip + 1}-{a.steps}, {a.runs} runs each)")
    table = []
    for k, v in runs.items():
        lo, hi = min(r["train_step_s"] for r in v), max(r["train_step_s"] for r in v)
        table.append([
            k, round(med(k, "train_step_s") * 1000), f"{lo * 1000:.0f}-{hi * 1000:.0f}", round(med(k, "push_s") * 1000),
            round(med(k, "compute_s") * 1000), round(statistics.fmean(r["trainer_busy_frac"] for r in v), 2),
            round(statistics.fmean(r["inference_busy_frac"] for r in v), 2),
        ])  # fmt: skip
    ratios = {}
    for b in ("true", "false"):
        pipe, conv = f"pipeline, bind_cores={b}", f"conventional, bind_cores={b}"
        ratios[b] = {part: med(pipe, part) / med(conv, part) for part in ("train_step_s", "compute_s")}
        print(
            f"pipeline / conventional, bind_cores={b}: step {ratios[b]['train_step_s']:.2f}x, "
            f"step less push {ratios[b]['compute_s']:.2f}x"
        )
    report(
        a.out / "contention.json",
        "Contention: the trainer step with engines generating beside it (pipeline) and idle (conventional)",
        ["setting", "step (ms)", "range", "push (ms)", "step less push (ms)", "trainer busy", "engine busy"],
        table,
        {"runs": runs, "ratio": ratios},
    )


if __name__ == "__main__":
    main()
