"""This machine's performance profile: what the job simulator (`pipelinerl_fsdp.perf`) is calibrated from, measured by
micro-benchmarks only (never by a learning run it then predicts).

    python -m benchmarks.perf_profile --engine-cost benchmarks/results/regime/engine_cost.json \
        --engine-cost-2t benchmarks/results/regime/engine_cost_2t.json --out benchmarks/results/regime/profile

Three parts, one profile file per engine and thread count (`OUT/<engine>_<threads>t.json`, the format of
`pipelinerl_fsdp.perf.profile`):
- decode: the engine's step against live sequences and context, from `benchmarks.engine_cost`'s JSON (its points and
  fit; run it first, 1 thread per engine as an inference rank of a 2-rank job, and with --threads 2 --engines
  reference for the colocated mode, which generates with every core);
- train: the job's RL trainer step (`benchmarks.rl_step_speed`: RLStep, packed micro-batches of
  --micro-batch-tokens, the job's loss, clipping, AdamW) of the --flavour model, at 1, 2, 3, 4 and 6 micro-batches per
  step with completions up to --max-completion tokens, fitted to step = base + per token x tokens + per micro-batch x
  micro-batches;
- push: one update of the model into a vLLM engine inside a 2-rank torchrun job (`benchmarks.vllm_update`, load way
  "reload"): the median pause, as the engine's fixed load time (the debug model's 3 MB make the bytes' share
  negligible: the bandwidth is then the spec's, stated).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import RESULTS
from pipelinerl_fsdp.perf.costs import PushCost
from pipelinerl_fsdp.perf.profile import Profile, fit_train, read_profile, save_profile

MICRO_BATCHES = (1, 2, 3, 4, 6)
BUCKET = 64 * 2**20  # world.weight_bucket_mb's default


def train_points(flavour: str, threads: int, mb_tokens: int, max_completion: int, work: Path) -> list[list[float]]:
    """[tokens, micro_batches, seconds] of the job's trainer step, one `rl_step_speed` run per micro-batch count."""
    points = []
    for m in MICRO_BATCHES:
        out = work / f"rl_step_{threads}t_{m}.json"
        cmd = [sys.executable, "-m", "benchmarks.rl_step_speed", "--flavour", flavour, "--micro-batch-tokens",
               str(mb_tokens), "--micro-batches", str(m), "--max-completion", str(max_completion), "--warmup", "1",
               "--steps", "3", "--threads", str(threads), "--compile", "off", "--out", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
        points.append([float(r["tokens"]), float(r["micro_batches"]), float(r["step_s"])])
        print(f"train {threads} thread(s): {r['micro_batches']} micro-batches, {r['tokens']} tokens: "
              f"{r['step_s']:.3f} s", flush=True)  # fmt: skip
    return points


def push_pause(flavour: str, work: Path) -> dict:
    """The median pause per update of a vLLM engine in a 2-rank job, and the bytes an update moves."""
    out = work / "vllm_update.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "benchmarks.vllm_update", "--flavour", flavour, "--loads", "reload", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["rows"][0]
    return {"pause_s": row["pause_ms_median"] / 1e3, "bytes": row["mb"] * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-cost", type=Path, required=True, help="benchmarks.engine_cost's JSON, 1 thread")
    ap.add_argument("--engine-cost-2t", type=Path, default=None, help="its JSON at --threads 2 (colocated)")
    ap.add_argument("--flavour", default="debug")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--max-completion", type=int, default=1040)
    ap.add_argument("--out", type=Path, default=RESULTS / "profile")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    costs = {1: json.loads(a.engine_cost.read_text())}
    if a.engine_cost_2t is not None:
        costs[2] = json.loads(a.engine_cost_2t.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        push = push_pause(a.flavour, Path(tmp))
        for threads, ec in costs.items():
            train = train_points(a.flavour, threads, a.micro_batch_tokens, a.max_completion, Path(tmp))
            cost, fit = fit_train(train, micro_batch_tokens=a.micro_batch_tokens)
            for engine, e in ec["engines"].items():
                decode = {**e["decode"], "points": [[p["live"], p["kv_sum"], p["step_s"]] for p in e["points"]]}
                profile = read_profile(
                    {"hardware": f"{ec['settings']['cpu']}, {threads} thread(s), {engine} engine",
                     "command": "python -m benchmarks.perf_profile " + " ".join(sys.argv[1:]), "decode": decode},
                )  # fmt: skip
                # the measured pause in all: the bytes at a stated loopback rate (1 GB/s, gloo here: ~3 ms of it), the
                # rest the engine's fixed load
                link = 1e9
                load = max(push["pause_s"] - push["bytes"] / link, 0.0)
                pcost = PushCost(bytes=push["bytes"], bucket_bytes=BUCKET, link_bytes_per_s=link, load_base_s=load)
                whole = Profile(profile.decode, cost, pcost, profile.hardware, profile.command)
                path = a.out / f"{engine}_{threads}t.json"
                save_profile(path, whole, {"decode": decode["points"], "train": train})
                print(f"{path}: decode fit rms {profile.fits['decode'].rms_rel:.1%}, train fit rms "
                      f"{fit.rms_rel:.1%}, pause {push['pause_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
