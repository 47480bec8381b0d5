"""The GPU check for the machine we are lent: one CUDA GPU, its own Python image (no vLLM, torchdata travelling as
a wheel, no network), one call of at most 10 minutes. It runs what no CPU test can show and writes one table
(`gpu_check.md`) and one JSON (`gpu_check.json`), rewritten before each part starts; each part's log lies beside
them. The parts' limits together exceed one call: `--parts` picks groups, `--budget-s` cuts the limits to fit.

    bash scripts/gpu_check.sh [OUT] [--parts lora,rl_step] [--budget-s 520]   # on the GPU machine
    bash scripts/gpu_check.sh --cpu [OUT] [--parts ...]   # the rehearsal on a CPU machine: the same parts, small shapes

Parts:
  startup_landed  the process-group calls of the code before the fix, on a trainer rank on CUDA and a CPU-only
                  inference rank (a vLLM rank's own process): expected to hang until its time limit on a GPU
  startup_fixed   the job's `init_world` in the same layout, then one exchange on every group: must finish
  job             the real job, 2 ranks: the FSDP2 trainer on CUDA, the reference engine on a CPU-only rank
                  (the layout of the first part): warm start, in-flight updates, versions, lag, ESS, pause
  ess_fp32_head   the colocated loop (one process, the engine on the GPU in bf16): ESS at lag 0 with the
  ess_bf16_head   trainer's head as a true fp32 root (`trainer.fp32_head=on`) and as bf16 operands with fp32
                  accumulation and fp32 logits (`auto`, the default): what the faster head costs, if anything
  step / step_ac  the bf16 FSDP2 trainer step on the Qwen2.5-0.5B shape, without and with activation
                  checkpointing: tokens/s, MFU, peak memory next to the plan's prediction, the SDPA kernel
  attention       attention over packed documents (Qwen2.5-0.5B heads, 32k tokens, documents up to 8k, bf16): the
                  one varlen kernel against the per-document loop, values and gradients against fp32, times, syncs
  rl_step_05b,    the job's RL step (RLStep) on random Qwen2.5-0.5B / 1.5B weights, 4 x 32k tokens of an RL
  rl_step_05b_eager, rl_step_15b   length mix: tokens/s, exact FLOPs, MFU, peak memory against the plan; compiled
                  (with a profile), eager, and 1.5B with activation checkpointing
  lora_step_05b   the same step under LoRA (rank 16, alpha 32, all seven linears): the bf16 frozen base and fp32
                  adapters under FSDP2 on CUDA, AdamW over the adapters: tokens/s, LoRA FLOPs, MFU, memory vs plan
  lora_merge      one engine update of Qwen2.5-7B's adapters merged on CUDA through `AdapterMerge` (bf16 W0 on the
                  GPU, then in pinned host memory): ms per update against the traffic and H2D bounds
  vllm_*          only where CUDA vLLM is installed (not on the lent machine): vLLM against the reference engine,
                  and a weight update into a CUDA vLLM engine while it generates
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PART_S = 20  # under --budget-s, a part with less time than this left is skipped


@dataclass
class Runner:
    """Runs the parts: each with its time limit, cut to what is left of --budget-s (a part with under
    `min_part_s` left is skipped), the table of the parts so far written before each starts (a call killed from
    outside still leaves it)."""

    out: Path
    env: dict[str, str]
    info: dict[str, str]
    deadline: float | None  # time.monotonic() by which every part must have ended
    rows: list[dict] = field(default_factory=list)
    min_part_s: float = MIN_PART_S

    def __call__(self, name: str, cmd: list[str], limit_s: float) -> dict:
        """Run one part; its output goes to OUT/name.log."""
        write_table(self.out, self.info, self.rows)
        log = self.out / f"{name}.log"
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < self.min_part_s:
                return {"part": name, "status": f"skipped (budget: {max(left, 0):.0f} s left)", "wall_s": 0.0}
            limit_s = min(limit_s, left)
        t0 = time.perf_counter()
        with log.open("w") as f:
            try:
                p = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s)
                status = "ok" if p.returncode == 0 else f"failed (exit {p.returncode})"
            except subprocess.TimeoutExpired:
                status = f"hung (killed after {limit_s:.0f} s)"
        return {"part": name, "status": status, "wall_s": round(time.perf_counter() - t0, 1), "log": log.name}


def write_table(out: Path, info: dict[str, str], rows: list[dict]) -> str:
    """gpu_check.md (one table, a column per key any row has) and gpu_check.json; returns the table's text."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and k != "log"]
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    head = f"GPU check on {info['device']}, Python {info['python']}, torch {info['torch']}"
    if "triton" in info:  # what compiled parts need
        head += f" (Triton {info['triton']}, C compiler {info['c_compiler']}, Python.h {info['python_h']})"
    text = head + "\n\n" + "\n".join(table)
    (out / "gpu_check.md").write_text(text + "\n")
    (out / "gpu_check.json").write_text(json.dumps({"machine": info, "parts": rows}, indent=2))
    return text


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


# the parts, by group (--parts)
GROUPS = ("startup", "job", "ess", "step", "rl_step", "attention", "lora", "vllm")  # the order they run in
# the groups that import the project's job code, and what it needs that the lent image may lack (torchdata: a wheel)
NEED_PACKAGES = {"job", "ess", "step", "rl_step", "lora"}
PACKAGES = ("torchdata", "transformers", "safetensors")


def missing_packages(groups: set[str]) -> list[str]:
    """The packages the chosen groups import that this Python cannot find."""
    if not groups & NEED_PACKAGES:
        return []
    return [m for m in PACKAGES if importlib.util.find_spec(m) is None]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def job_summary(folder: Path) -> dict:
    """What the job's metrics say about its in-flight updates."""
    recs = records(folder / "rl" / "metrics.jsonl")
    if not recs:
        return {}
    last = recs[-1]

    def col(key: str) -> list[float]:
        return [r[key] for r in recs if isinstance(r.get(key), (int, float))]

    return {
        "steps": last.get("step"),
        "version": last.get("version"),
        "lag_mean": round(statistics.mean(col("lag_mean")), 2) if col("lag_mean") else None,
        "lag_max": max(col("lag_max")) if col("lag_max") else None,
        "ess_min": round(min(col("ess")), 5) if col("ess") else None,
        "update_pause_ms_median": round(statistics.median(col("update_pause_ms")), 1)
        if col("update_pause_ms")
        else None,
        "reward_last": last.get("reward_mean"),
    }


def ess_summary(folder: Path) -> dict:
    recs = records(folder / "rl" / "metrics.jsonl")
    ess = [r["ess"] for r in recs if isinstance(r.get("ess"), (int, float))]
    if not ess:
        return {}
    return {"steps": len(ess), "ess_mean": round(statistics.mean(ess), 6), "ess_min": round(min(ess), 6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="rehearse on a CPU machine (device cpu, small shapes)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    p.add_argument(
        "--parts",
        default="all",
        help=f"comma list of part groups to run: {', '.join(GROUPS)} (default: all); the job's warm start comes "
        "from `job`, which the `ess` parts need",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole check ends within this many seconds: each part's limit is cut to what is left, parts "
        "that would start with under 20 s are skipped (set it below the device call's timeout)",
    )
    a = p.parse_args()
    t_start = time.monotonic()
    groups = set(GROUPS) if a.parts == "all" else set(a.parts.split(","))
    if groups - set(GROUPS):
        raise SystemExit(f"--parts: unknown {sorted(groups - set(GROUPS))}; choose from {', '.join(GROUPS)}")
    missing = missing_packages(groups)
    if missing:
        raise SystemExit(
            f"gpu_check: {', '.join(missing)} not importable by {sys.executable}, which the parts "
            f"{', '.join(sorted(groups & NEED_PACKAGES))} import: run `bash scripts/gpu_wheels.sh` where the device "
            "call is made and pass carry=['.gpu_wheels'] (scripts/gpu_check.sh puts its wheels on PYTHONPATH)"
        )
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if a.cpu else "cuda"
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")
    )
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    import torch

    info = {
        "device": torch.cuda.get_device_name(0) if not a.cpu else "cpu (rehearsal)",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        # what compiled parts need on the GPU: Triton builds its launcher with a C compiler and Python's headers
        "triton": importlib.util.find_spec("triton") is not None,
        "c_compiler": next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None),
        "python_h": (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
    }
    print(json.dumps(info), flush=True)
    deadline = None if a.budget_s is None else t_start + a.budget_s
    run = Runner(out, env, info, deadline)
    rows = run.rows
    probe = [str(ROOT / "scripts" / "startup_probe.py"), "--device", device]
    if "startup" in groups:
        rows.append(run("startup_landed", torchrun(2, *probe, "--layout", "landed"), 40))
        rows.append(run("startup_fixed", torchrun(2, *probe, "--layout", "fixed"), 60))

    ws, job_out = out / "warmstart", out / "job"
    job = [
        "--config",
        "arithmetic",
        "--job.stage=rl",
        f"--job.device={device}",
        "--inference.engine=reference",
        "--inference.device=cpu",
        f"--warmstart.path={ws}",
        # a policy with rewards to learn from (the default warm start is 76% at 1000 steps): stop at 50%
        "--warmstart.steps=1000",
        "--warmstart.eval_every=100",
        "--warmstart.stop_at_accuracy=0.5",
        "--task.eval_size=128",
        f"--job.output_dir={job_out}",
        "--rl.max_steps=40",
        "--eval.every=0",
        "--eval.at_start=false",
        "--metrics.log_every=10",
        "--job.threads_per_rank=1",
    ]
    if "job" in groups:
        row = run("job", torchrun(2, str(ROOT / "run_train.py"), *job), 200)
        row.update(job_summary(job_out))
        rows.append(row)

    # bf16 blocks on the GPU ("auto"); the rehearsal asks for them too, since on CPU "auto" is fp32 and every head
    # setting then computes the same fp32 head
    params = "bfloat16" if a.cpu else "auto"
    for name, head in (("ess_fp32_head", "on"), ("ess_bf16_head", "auto")) if "ess" in groups else ():
        folder = out / name
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.colocated",
            "--config",
            "arithmetic",
            f"--job.device={device}",
            f"--warmstart.path={ws}",
            f"--trainer.fp32_head={head}",
            f"--trainer.param_dtype={params}",
            f"--job.output_dir={folder}",
            "--rl.max_steps=15",
            "--metrics.log_every=5",
        ]
        row = run(name, cmd, 60)
        row.update(ess_summary(folder))
        rows.append(row)

    shape = ["--flavour", "debug", "--tokens", "1024"] if a.cpu else ["--flavour", "qwen2.5-0.5b", "--tokens", "8192"]
    for name, extra in (("step", []), ("step_ac", ["--checkpointing"])) if "step" in groups else ():
        js = out / f"{name}.json"
        cmd = [sys.executable, "-m", "benchmarks.train_step_speed", *shape, "--docs", "8"]
        row = run(name, [*cmd, *extra, "--out", str(js)], 90)
        if js.is_file():
            step = json.loads(js.read_text())
            row.update({k: step[k] for k in ("tokens_per_s", "mfu", "peak_mem_gib", "plan_gib", "sdpa_kernel")})
        rows.append(row)

    # the RL step as a run trains (issue: the trainer at GPU speed): 4 x 32k-token micro-batches of an RL length mix,
    # exact FLOPs and MFU; compiled blocks with the profile of one step, the same eager, and the 1.5B shape
    rl_parts = (
        (
            "rl_step_05b",
            ["--flavour", "qwen2.5-0.5b", "--compile", "on", "--profile", str(out / "rl_step_05b_profile.txt")],
        ),
        # its own profile too: the breakdown survives a compile failure of the part above
        (
            "rl_step_05b_eager",
            ["--flavour", "qwen2.5-0.5b", "--compile", "off", "--profile", str(out / "rl_step_05b_eager_profile.txt")],
        ),
        # 2 warm-up steps (eager: nothing to compile), then 10 timed; a slow GPU stopped at 150 s keeps its steps so far
        ("rl_step_15b", ["--flavour", "qwen2.5-1.5b", "--checkpointing", "--warmup", "2"]),
    )
    for name, extra in rl_parts if "rl_step" in groups else ():
        js = out / f"{name}.json"
        if a.cpu:  # the rehearsal: the debug shape, CPU sizes
            extra = ["--flavour", "debug", "--quick", *extra[2:]]
        cmd = [sys.executable, "-m", "benchmarks.rl_step_speed", *extra, "--out", str(js)]
        row = run(name, cmd, 150)
        if js.is_file():
            step = json.loads(js.read_text())
            keep = ("tokens_per_s", "tflop_step", "achieved_tflop_s", "mfu", "frac_of_matmul_rate", "peak_mem_gib")
            keep += ("plan_gib", "compile", "pack_s", "pack_frac", "timed_steps", "partial")
            row.update({k: step[k] for k in keep if k in step})  # "partial": stopped by a limit (no matmul rate)
        rows.append(row)

    # attention over packed documents: the one varlen kernel against the per-document loop (docs/gpu.md)
    if "attention" in groups:
        js = out / "attention.json"
        tiny = ["--tokens", "512", "--max-doc", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
        cmd = [sys.executable, "-m", "benchmarks.packed_attention", "--device", device, *(tiny if a.cpu else [])]
        cmd += ["--out", str(js)]
        row = run("attention", cmd, 120)
        if js.is_file():
            att = json.loads(js.read_text())
            row.update({k: att[k] for k in ("attn_docs", "loop_ms", "varlen_ms", "speedup", "loop_err", "varlen_err")})
            row.update(agree=att["agree"], varlen_syncs=att["syncs"].get("varlen", att["varlen_status"]))
            row.update({f"{k}_peak_gib": v for k, v in att["peak_gib"].items()})
        rows.append(row)

    # LoRA's GPU path (docs/gpu.md): the RL step with a bf16 frozen base and fp32 adapters under FSDP2; one engine
    # update merged on CUDA through AdapterMerge, W0 on the GPU and in pinned host memory. The rehearsal: the debug
    # shape with a bf16 base on CPU (the same mixed-dtype FSDP2 units), the merge on CPU in fp32
    if "lora" in groups:
        js = out / "lora_step_05b.json"
        # 2 + 5 steps on the GPU (the rl_step parts run 3 + 10): a median of 5 is enough beside them
        shape = ["--flavour", "qwen2.5-0.5b", "--warmup", "2", "--steps", "5"]
        shape = ["--flavour", "debug", "--quick", "--param-dtype", "bfloat16"] if a.cpu else shape
        cmd = [sys.executable, "-m", "benchmarks.rl_step_speed", *shape, "--lora-rank", "16"]
        row = run("lora_step_05b", [*cmd, "--out", str(js)], 120)
        if js.is_file():
            step = json.loads(js.read_text())
            keep = ("lora_rank", "trained_params_m", "dtype", "tokens_per_s", "tflop_step", "tflop_adapters")
            keep += ("achieved_tflop_s", "mfu", "frac_of_matmul_rate", "peak_mem_gib", "plan_gib", "compile")
            keep += ("pack_s", "timed_steps", "partial")
            row.update({k: step[k] for k in keep if k in step})
        rows.append(row)
        js = out / "lora_merge.json"
        shape = ["--device", "cpu", "--flavour", "debug"] if a.cpu else ["--device", "cuda", "--flavour", "qwen2.5-7b"]
        cmd = [sys.executable, "-m", "benchmarks.lora_merge_speed", *shape, "--base", "device,host", "--reps", "3"]
        row = run("lora_merge", [*cmd, "--out", str(js)], 120)
        if js.is_file():
            merge = json.loads(js.read_text())
            row.update(merge_dtype=merge["dtype"], d2d_gb_s=merge["d2d_gb_s"], h2d_gb_s=merge["h2d_gb_s"])
            addmm = statistics.median(merge["times_s"]["merged_weight (addmm)"])
            row["addmm_only_ms"] = round(addmm * 1e3, 2)
            for u in merge["updates"]:
                where = u["base"]
                row.update({f"w0_{where}_ms": u["ms"], f"w0_{where}_traffic_bound_ms": u["traffic_bound_ms"]})
                row.update({f"w0_{where}_peak_temp_gib": u["peak_temp_gib"]})
                row.update({"w0_gib": u["w0_gib"], **({"h2d_bound_ms": u["h2d_bound_ms"]} if where == "host" else {})})
        rows.append(row)

    # a GPU machine of the user's, with CUDA vLLM
    if "vllm" in groups and not a.cpu and importlib.util.find_spec("vllm") is not None:
        rows.append(
            run(
                "vllm_engines",
                [sys.executable, "-m", "benchmarks.engines", "--gpu", "--flavours", "qwen2.5-0.5b"]
                + ["--prompts", "64", "--max-tokens", "128", "--out", str(out / "vllm_engines.json")],
                150,
            )
        )
        update = ["-m", "benchmarks.vllm_update", "--gpu", "--flavour", "qwen2.5-0.5b", "--updates", "5"]
        update += ["--loads", "reload,inplace", "--out", str(out / "vllm_update.json")]
        rows.append(run("vllm_update", torchrun(2, *update), 120))

    print(write_table(out, info, rows), flush=True)


if __name__ == "__main__":
    main()
