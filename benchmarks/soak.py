"""Soak: does any process of the job grow in host memory over a long run? The default CPU job runs for
`--minutes` (checkpoints, evaluations and weight updates included, as configured), while the resident set size
(RSS) of every process of the job (torchrun, each rank, vLLM's engine core and workers, reward workers) is sampled
every `--every` seconds; then the job is stopped with SIGTERM (the launcher's Ctrl-C path).

    python -m benchmarks.soak [--config arithmetic] [--minutes 30] [--warmup-minutes 5] [--every 10] \
        [--max-growth 0.05] [--out benchmarks/results/soak] [-- extra job overrides]

Growth per process: the median of its last 3 samples against the median of the 3 samples around the end of the
warm-up (start-up, the first KV-cache pages and allocator pools are not a leak). Prints a table, writes JSON and
(with matplotlib) a plot of RSS over time; exits 1 when any process, or the whole job, grew by more than
`--max-growth`.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.harness import ROOT, read_metrics, report
from pipelinerl_fsdp.runtime.processes import descendants, parent_of
from pipelinerl_fsdp.runtime.torchrun import job_command


def rss_mb(pid: int) -> float | None:
    """Resident set size of `pid` in MB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rank_of(pid: int, launcher: int) -> str:
    """The RANK of the nearest process at or above `pid` that has one (vLLM's processes start with a clean
    environment: their rank is their ancestor's)."""
    while pid and pid != launcher:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return "?"
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            return rank
        pid = parent_of(pid) or 0
    return "?"


def label(pid: int, launcher: int) -> str:
    """A readable name for a process of the job: the launcher, a rank, or what vLLM calls its processes."""
    if pid == launcher:
        return "torchrun"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid}"
    rank = rank_of(pid, launcher)
    if "EngineCore" in cmd:
        return f"rank {rank} vLLM engine core"
    if "VllmWorker" in cmd or "vllm" in cmd.lower() and "worker" in cmd.lower():
        return f"rank {rank} vLLM worker"
    if "run_train.py" in cmd:
        return f"rank {rank}"
    if "multiprocessing" in cmd:
        return f"rank {rank} child {pid}"
    return f"rank {rank} {cmd[:40]}"


def growth(series: list[tuple[float, float]], warmup_s: float) -> tuple[float, float, float] | None:
    """(RSS after warm-up, RSS at the end, relative growth) from (time, MB) samples; None if too short."""
    after = [mb for t, mb in series if t >= warmup_s]
    if len(after) < 6:
        return None
    start, end = statistics.median(after[:3]), statistics.median(after[-3:])
    return start, end, (end - start) / start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--warmup-minutes", type=float, default=5)
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="arithmetic", help="the job's config (default: the default CPU job's)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    p.add_argument("job_args", nargs="*", help="overrides for the job (after --)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    job_dir = a.out / "job"
    cmd, env = job_command(
        a.nproc,
        "--config",
        a.config,
        "--rl.max_steps=100000000",
        f"--job.output_dir={job_dir}",
        "--checkpoint.resume=off",
        *a.job_args,
    )
    series: dict[str, list[tuple[float, float]]] = {}
    with open(a.out / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.time()
        try:
            while time.time() - t0 < a.minutes * 60:
                if proc.poll() is not None:
                    raise SystemExit(f"the job ended early ({proc.returncode}); log {a.out / 'job.log'}")
                now = time.time() - t0
                for pid in [proc.pid, *descendants(proc.pid)]:
                    mb = rss_mb(pid)
                    if mb is not None:
                        series.setdefault(label(pid, proc.pid), []).append((now, mb))
                total = sum(s[-1][1] for s in series.values() if s and s[-1][0] == now)
                series.setdefault("whole job", []).append((now, total))
                time.sleep(a.every)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    recs = read_metrics(job_dir / "rl" / "metrics.jsonl") if (job_dir / "rl" / "metrics.jsonl").exists() else []
    warmup = a.warmup_minutes * 60
    rows, failed = [], []
    print(f"soak: {a.minutes:g} min, {recs[-1]['step'] if recs else 0} steps; growth after {a.warmup_minutes:g} min")
    for name, s in sorted(series.items(), key=lambda kv: kv[0] != "whole job"):
        g = growth(s, warmup)
        if g is None:  # a short-lived process (a reward worker replaced, a helper)
            continue
        start, end, rel = g
        rows.append({"process": name, "rss_start_mb": start, "rss_end_mb": end, "growth": rel, "samples": len(s)})
        if rel > a.max_growth:
            failed.append(name)
    result = {
        "minutes": a.minutes,
        "warmup_minutes": a.warmup_minutes,
        "steps": recs[-1]["step"] if recs else 0,
        "max_growth": a.max_growth,
        "command": cmd,
        "processes": rows,
        "series": series,
        "failed": failed,
    }
    report(
        a.out / "soak.json",
        "Soak: resident memory of every process of the job over a long run",
        ["process", "RSS after warm-up (MB)", "RSS at end (MB)", "growth", "samples"],
        [[r["process"], round(r["rss_start_mb"]), round(r["rss_end_mb"]), f"{r['growth']:+.1%}", r["samples"]]
         for r in rows],
        result,
    )  # fmt: skip
    plot(series, warmup, a.out / "soak.png")
    if failed:
        raise SystemExit(f"RSS grew by more than {a.max_growth:.0%} after the warm-up: {', '.join(failed)}")
    print(f"no process grew by more than {a.max_growth:.0%} after the warm-up; JSON in {a.out / 'soak.json'}")


def plot(series: dict[str, list[tuple[float, float]]], warmup_s: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot written", flush=True)
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, s in series.items():
        if len(s) >= 6:
            ax.plot([t / 60 for t, _ in s], [mb for _, mb in s], label=name)
    ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
