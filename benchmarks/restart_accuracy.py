"""Does a run that is killed and restarted learn like one that is not? The default CPU job (1 engine + 1 trainer,
from the warm start), `--steps` optimizer steps with checkpoints every `--interval`, runs `--runs` times
uninterrupted and `--runs` times with a trainer rank killed (SIGKILL) at step `--kill-at` under
`torchrun --max-restarts=1`, so that the restarted job resumes from the newest complete checkpoint. Compared: the
final held-out greedy accuracy (500 fixed problems, on the engine) and the accuracy at the checkpoint the restart
resumed from (what a resume that lost its progress would end near).

    python -m benchmarks.restart_accuracy [--runs 5] [--steps 200] [--interval 25] [--kill-at 110] \
        [--out benchmarks/results/restart_accuracy] [-- extra job overrides]

Prints a table, writes JSON (every run's accuracies, resume step and wall time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.harness import ROOT, read_metrics, report
from pipelinerl_fsdp.runtime.torchrun import job_command


def one_run(out: Path, args: argparse.Namespace, extra: list[str], kill: bool) -> dict:
    """One job; its held-out accuracy per evaluated version, the resume step (None if it did not restart)."""
    job = [
        "--config",
        "arithmetic",
        f"--model.path={args.warm}",
        f"--job.output_dir={out}",
        f"--rl.max_steps={args.steps}",
        f"--eval.every={args.eval_every}",
        f"--checkpoint.interval={args.interval}",
        "--job.threads_per_rank=1",
        *extra,
    ]
    cmd, env = job_command(2, *job, max_restarts=1)
    if kill:
        env["PIPELINERL_FAULT"] = f"0:{args.kill_at}:kill"
    t0 = time.time()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    if r.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}; log {log}:\n{text[-4000:]}")
    recs = read_metrics(out / "rl" / "metrics.jsonl")
    steps = [x["step"] for x in recs]
    if steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"{log}: steps logged {steps[:5]}...{steps[-5:]}, not 1..{args.steps} once each")
    evals = {
        x["eval/heldout/version"]: x["eval/heldout/pass@1"]
        for x in read_metrics(out / "rl" / "evals.jsonl")
        if "eval/heldout/version" in x
    }
    for bulky in ("checkpoints", "final"):  # tens of MB per run; the metrics and the log stay
        shutil.rmtree(out / bulky, ignore_errors=True)
    resumed = None
    if "resumed from" in text:
        resumed = int(text.split("resumed from")[1].split("at step")[1].split(",")[0])
    return {"evals": evals, "final": evals[max(evals)], "resumed_at": resumed, "wall_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=25)
    p.add_argument("--kill-at", type=int, default=110)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--warm", default=str(ROOT / "outputs" / "warmstart" / "addition-debug"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "restart_accuracy")
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if not Path(args.warm, "config.json").is_file():
        raise SystemExit(f"no warm start in {args.warm}: run the default job once (./run_train.sh) to train it")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"uninterrupted": [], "restarted": []}
    for i in range(args.runs):
        for kind in results:
            out = args.out / f"{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            r = one_run(out, args, extra, kill=kind == "restarted")
            results[kind].append(r)
            print(
                f"{kind:13s} run {i}: final {r['final']:.3f}, resumed at {r['resumed_at']}, {r['wall_s']:.0f} s",
                flush=True,
            )
    resume_step = args.kill_at // args.interval * args.interval
    table = []
    for kind, rs in results.items():
        finals = [r["final"] for r in rs]
        mid = [r["evals"].get(resume_step) for r in rs]
        mid_s = " ".join(f"{m:.3f}" for m in mid if m is not None) or "-"
        table.append([kind, f"{min(finals):.3f} / {statistics.mean(finals):.3f} / {max(finals):.3f}", mid_s])
    report(
        args.out / "results.json",
        "Restart accuracy: killed and restarted runs against uninterrupted ones",
        ["run", "final accuracy (min / mean / max)", f"accuracy at step {resume_step}"],
        table,
        {"args": {k: str(v) for k, v in vars(args).items()}, "extra": extra, **results},
    )


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
