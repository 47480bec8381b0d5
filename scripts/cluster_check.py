"""The default job on the two-node cluster of `scripts/cluster.sh` (network + UTS namespaces joined by a veth pair,
a real SLURM), and the faults a cluster has. Run before each change to the launch path (run_train.sh,
scripts/slurm_train.sh, the rendezvous, process groups, transports); docs/cluster.md holds the last results.

    bash scripts/cluster.sh up                                  # once (root)
    python scripts/cluster_check.py --out DIR one-node torchrun # each part's JSON in DIR/results/, logs in DIR/PART/
    python scripts/cluster_check.py --out DIR slurm crash link interface rendezvous scancel
    python scripts/cluster_check.py --out DIR table             # the markdown tables of docs/cluster.md
    bash scripts/cluster.sh down

Parts (each well under 10 minutes on a 2-core machine once DIR/warmstart exists; `one-node` makes it):
  one-node    the default job on one machine (no namespaces): the baseline of the side-by-side table
  torchrun    the default job, one process per node: torchrun on each node, c10d rendezvous at node0:29500
  slurm       the same through the real wrapper: sbatch --nodes 2 scripts/slurm_train.sh --config arithmetic
  crash       every process of node1 killed mid-run (torchrun); then the same job resubmitted: where it resumed
  link        node1's link down for 20 s mid-run (weights and rollouts in flight), then up
  link-long   node1's link down for 60 s with --world.timeout_s=30: the job ends by its deadline, named
  vanish      node1's link down for good at step 40 (a node powered off): how long each side lives on, what it says
  crash-node0 the same with node0 (the trainer, the job's store) killed: the engine's node is the survivor
  crash-slurm every process of node1 (its slurmd too) killed under SLURM: requeued, resumed once the node is back
  interface   GLOO_SOCKET_IFNAME naming no interface, and naming the loopback (both nodes)
  rendezvous  RDZV_ENDPOINT an address nobody has, and a name that does not resolve
  scancel     a SLURM job cancelled mid-run: every process on both nodes gone, the last checkpoint intact
Both nodes share this machine's cores: every rank runs 1 thread (OMP_NUM_THREADS=1, --job.threads_per_rank=1), as
the two processes of the one-node job do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelinerl_fsdp.checkpoint_layout import newest_intact  # noqa: E402

CLUSTER = ["bash", str(REPO / "scripts" / "cluster.sh")]
NODES = ("node0", "node1")
PYTHON = str(REPO / ".venv" / "bin" / "python")


def on_node(node: str, env: dict[str, str], argv: list[str]) -> list[str]:
    """The command line that runs `argv` on `node` (its namespaces) with `env` added."""
    return [*CLUSTER, "exec", node, "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def job_args(out: Path, run: Path, *extra: str) -> list[str]:
    """run_train.py arguments of the default job writing to `run`, starting from the shared warm start."""
    return [
        "--config",
        "arithmetic",
        f"--warmstart.path={out / 'warmstart'}",
        f"--job.output_dir={run}",
        "--job.threads_per_rank=1",
        *extra,
    ]


def torchrun_env(run_id: str, rdzv: str = "node0:29500", **extra: str) -> dict[str, str]:
    """run_train.sh's multi-node variables: 1 process per node, the c10d rendezvous at `rdzv`."""
    return {
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "RDZV_ENDPOINT": rdzv,
        "RDZV_ID": run_id,
        "SKIP_SETUP": "1",
        "PYTHON": PYTHON,
        "OMP_NUM_THREADS": "1",
        **extra,
    }


class TwoNodeJob:
    """run_train.sh started on both nodes at once (as an operator, or srun, does), each node's console in a file."""

    def __init__(
        self, out: Path, run: Path, args: list[str], env: dict[str, str], node_env: dict | None = None, log_suffix=""
    ):
        run.parent.mkdir(parents=True, exist_ok=True)
        self.logs = {n: run.parent / f"{run.name}{log_suffix}.{n}.log" for n in NODES}
        self.t0 = time.monotonic()
        self.procs = {}
        for n in NODES:
            e = {**env, **(node_env or {}).get(n, {})}
            with open(self.logs[n], "w") as f:
                self.procs[n] = subprocess.Popen(
                    on_node(n, e, ["bash", "run_train.sh", *args]), cwd=REPO, stdout=f, stderr=subprocess.STDOUT
                )

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        """Each node's exit status (None: still running at the deadline, then killed)."""
        deadline = self.t0 + timeout_s
        codes: dict[str, int | None] = {}
        for n, p in self.procs.items():
            try:
                codes[n] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[n] = None
        if None in codes.values():
            for n in NODES:
                job_processes_kill(n)
        return codes

    def console(self, node: str) -> str:
        return self.logs[node].read_text(errors="replace")


DAEMONS = {"slurmctld", "slurmscriptd", "slurmd"}


def alive_job_process(pid: int) -> bool:
    """A live process that is not one of the cluster's daemons (a zombie is gone: this container's init reaps late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and comm not in DAEMONS


def node_pids(node: str) -> set[int]:
    """Every live process of the node's network namespace but the SLURM daemons: what a job left running there."""
    name = f"{os.environ.get('CLUSTER_PREFIX', 'plrl')}-{node}"
    r = subprocess.run(["ip", "netns", "pids", name], capture_output=True)
    return {int(x) for x in r.stdout.split() if alive_job_process(int(x))}


def job_processes_kill(node: str) -> None:
    """SIGKILL what a part left running on a node (its own job's processes only: the daemons are kept)."""
    for pid in node_pids(node):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def wait_until(cond, timeout_s: float, every: float = 0.2) -> float | None:
    """Seconds until `cond()` held, or None at the deadline."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(every)
    return None


def fresh(out: Path, part: str) -> Path:
    """The part's folder emptied (a run there resumes from what it finds): its run folder inside."""
    shutil.rmtree(out / part, ignore_errors=True)
    (out / part).mkdir(parents=True)
    return out / part / "run"


def records(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The run's RL records (metrics.jsonl or evals.jsonl under its rl/ folder)."""
    path = run / "rl" / name
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def last_step(run: Path) -> int:
    recs = records(run)
    return recs[-1]["step"] if recs else -1


def summary(run: Path) -> dict:
    """What the side-by-side table shows: steps, final held-out accuracy, update pauses, rollout throughput."""
    recs = records(run)
    evals = records(run, "evals.jsonl")
    acc = [(e["step"], e.get("eval/heldout/pass@1")) for e in evals if "eval/heldout/pass@1" in e]
    # NaN (a step without an update) is not equal to itself
    pauses = [r["update_pause_ms"] for r in recs if r.get("update_pause_ms", float("nan")) == r.get("update_pause_ms")]

    maxima = [r["update_pause_ms_max"] for r in recs if r.get("update_pause_ms_max", 0) > 0]  # NaN > 0 is False

    def median(key: str) -> float | None:
        vals = [r[key] for r in recs if r.get(key, float("nan")) == r.get(key)]
        return round(statistics.median(vals), 3) if vals else None

    return {
        "steps": recs[-1]["step"] if recs else None,
        "rl_wall_s": recs[-1]["wall_time_s"] if recs else None,
        "heldout_accuracy": acc,
        "update_pause_ms_median": statistics.median(pauses) if pauses else None,
        "update_pause_ms_max": max(maxima, default=None),
        "gen_tokens_per_s_median": median("gen_tokens_per_s"),
        "push_s_median": median("push_s"),
        "push_mb": median("push_mb"),
        "broadcast_mb_per_s_median": median("broadcast_mb_per_s"),
        "trainer_busy_frac_median": median("trainer_busy_frac"),
        "lag_mean_median": median("lag_mean"),
        "exports": sorted(p.name for p in run.glob("final")) + sorted(p.name for p in (run / "exports").glob("*")),
    }


ERROR_RE = re.compile(r"(Error|error:|failed|Timeout|timed out|refused|unreachable|closed by peer|Signal)")


def cause_lines(text: str, n: int = 4) -> list[str]:
    """The console's first lines that name what went wrong (error, timeout, refused...)."""
    return [line.strip()[:300] for line in text.splitlines() if ERROR_RE.search(line)][:n]


def save(out: Path, part: str, result: dict) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / f"{part}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def require_cluster() -> None:
    if (
        not node_pids("node0")
        and subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.find("node0") < 0
    ):
        sys.exit("the cluster is not up: bash scripts/cluster.sh up")


# ---- parts ----


def part_one_node(out: Path) -> dict:
    run = out / "one-node" / "run"
    t0 = time.monotonic()
    log = out / "one-node" / "run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SKIP_SETUP": "1", "PYTHON": PYTHON}
    with open(log, "w") as f:
        rc = subprocess.run(["bash", "run_train.sh", *job_args(out, run)], cwd=REPO, env=env, stdout=f, stderr=f)
    return {"rc": rc.returncode, "wall_s": round(time.monotonic() - t0, 1), **summary(run)}


def part_torchrun(out: Path) -> dict:
    require_cluster()
    run = fresh(out, "torchrun")
    job = TwoNodeJob(out, run, job_args(out, run), torchrun_env("torchrun"))
    codes = job.wait(540)
    # rank 0 (the trainer) prints the step lines; the engine's rank starts vLLM
    placed = {
        n: [role for role, mark in (("trainer", "[rl] step"), ("vllm engine", "vllm")) if mark in job.console(n)]
        for n in NODES
    }
    return {"rc": codes, "wall_s": round(time.monotonic() - job.t0, 1), "placement": placed, **summary(run)}


def slurm(argv: list[str]) -> str:
    """A SLURM command's output, run on node0 (squeue -j of a job that has left the queue fails: empty output)."""
    return subprocess.run(on_node("node0", {}, argv), cwd=REPO, capture_output=True, text=True).stdout


def sbatch(out: Path, run: Path, *extra: str) -> str:
    """Submit the default job through the real wrapper from node0; returns the job id."""
    run.parent.mkdir(parents=True, exist_ok=True)
    argv = ["sbatch", "--parsable", "--nodes", "2", f"--output={run.parent / (run.name + '-%j.out')}"]
    argv += ["scripts/slurm_train.sh", *job_args(out, run, *extra)]
    return subprocess.run(
        on_node("node0", {"GPUS_PER_NODE": "1", "PYTHON": PYTHON, "OMP_NUM_THREADS": "1"}, argv),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def job_state(job: str) -> str:
    return slurm(["squeue", "-h", "-j", job, "-o", "%T"]).strip() if job else ""


def part_slurm(out: Path) -> dict:
    require_cluster()
    run = fresh(out, "slurm")
    t0 = time.monotonic()
    job = sbatch(out, run)
    gone = wait_until(lambda: job_state(job) == "", 540, every=1.0)
    text = next(run.parent.glob(f"run-{job}.out")).read_text(errors="replace")
    return {
        "job": job,
        "ended": gone is not None,
        "wall_s": round(time.monotonic() - t0, 1),
        "errors": cause_lines(text),
        **summary(run),
    }


def part_crash(out: Path, node: str = "node1") -> dict:
    """Every process of `node` killed at step 50 (torchrun, checkpoints every 20 steps): how long the other node's
    processes live on, what its console says; then the same command again, and where it resumed."""
    require_cluster()
    part = "crash" if node == "node1" else f"crash-{node}"
    survivor = "node0" if node == "node1" else "node1"
    run = fresh(out, part)
    args = job_args(out, run, "--checkpoint.interval=20", "--rl.max_steps=120")
    job = TwoNodeJob(out, run, args, torchrun_env(part))
    at = wait_until(lambda: last_step(run) >= 50, 300)
    assert at is not None, f"the job never reached step 50: {job.logs}"
    step_killed = last_step(run)
    t_kill = time.monotonic()
    subprocess.run([*CLUSTER, "kill", node], check=True)
    codes = job.wait(time.monotonic() - job.t0 + 120)
    ended_s = time.monotonic() - t_kill
    left = wait_until(lambda: not node_pids("node0") and not node_pids("node1"), 10)
    subprocess.run([*CLUSTER, "revive", node])  # its slurmd died with it (none on a CLUSTER_NO_SLURM cluster)
    ck, _ = newest_intact(run / "checkpoints")
    # resubmitted: the same command again (checkpoint.resume "auto": the newest intact checkpoint)
    t1 = time.monotonic()
    job2 = TwoNodeJob(out, run, args, torchrun_env(part + "-again"), log_suffix="-resubmitted")
    codes2 = job2.wait(480)
    resumed = re.findall(r"\[rl\] resumed from [^\n]*", job2.console("node0"))
    return {
        "killed": node,
        "killed_at_step": step_killed,
        "survivor_rc": codes[survivor],
        "survivor_ended_s": round(ended_s, 1),
        "processes_left_after_10s": left is None,
        "survivor_cause": cause_lines(job.console(survivor), 6),
        "newest_intact_checkpoint": ck.name if ck else None,
        "resubmitted_rc": codes2,
        "resubmitted_wall_s": round(time.monotonic() - t1, 1),
        "resumed": resumed,
        **summary(run),
    }


def part_link(out: Path, down_s: float = 20.0) -> dict:
    require_cluster()
    run = fresh(out, "link")
    args = job_args(out, run, "--rl.max_steps=150")
    job = TwoNodeJob(out, run, args, torchrun_env("link"))
    assert wait_until(lambda: last_step(run) >= 40, 300) is not None, f"never reached step 40: {job.logs}"
    step_down = last_step(run)
    subprocess.run([*CLUSTER, "link", "node1", "down"], check=True)
    time.sleep(down_s)
    subprocess.run([*CLUSTER, "link", "node1", "up"], check=True)
    t_up = time.monotonic()
    resumed_s = wait_until(lambda: last_step(run) > step_down + 2, 240)
    codes = job.wait(time.monotonic() - job.t0 + 300)
    recs = records(run)
    gaps = [(b["step"], round(b["wall_time_s"] - a["wall_time_s"], 1)) for a, b in zip(recs, recs[1:])]
    worst = max(gaps, key=lambda g: g[1]) if gaps else None
    return {
        "link_down_at_step": step_down,
        "down_s": down_s,
        "steps_again_after_up_s": None if resumed_s is None else round(resumed_s, 1),
        "rc": codes,
        "longest_gap_between_steps": worst,
        "causes_node0": cause_lines(job.console("node0")),
        "causes_node1": cause_lines(job.console("node1")),
        "after_up_s": round(time.monotonic() - t_up, 1),
        **summary(run),
    }


def part_link_long(out: Path, down_s: float = 60.0, timeout_s: int = 30) -> dict:
    """node1's link down for longer than world.timeout_s (here 30 s): the trainer must end by its deadline, naming
    the wait; node1 hears of it when the link is back (as a node that vanished for good never would)."""
    require_cluster()
    run = fresh(out, "link-long")
    job = TwoNodeJob(
        out, run, job_args(out, run, "--rl.max_steps=300", f"--world.timeout_s={timeout_s}"), torchrun_env("ll")
    )
    assert wait_until(lambda: last_step(run) >= 40, 300) is not None, f"never reached step 40: {job.logs}"
    step_down = last_step(run)
    subprocess.run([*CLUSTER, "link", "node1", "down"], check=True)
    t0 = time.monotonic()
    node0_end = wait_until(lambda: job.procs["node0"].poll() is not None, down_s)
    time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
    subprocess.run([*CLUSTER, "link", "node1", "up"], check=True)
    t_up = time.monotonic()
    codes = job.wait(time.monotonic() - job.t0 + 120)
    return {
        "link_down_at_step": step_down,
        "down_s": down_s,
        "world_timeout_s": timeout_s,
        "node0_ended_after_down_s": None if node0_end is None else round(node0_end, 1),
        "node1_ended_after_up_s": round(time.monotonic() - t_up, 1),
        "rc": codes,
        "cause_node0": cause_lines(job.console("node0")),
        "cause_node1": cause_lines(job.console("node1")),
        "last_step": last_step(run),
    }


def part_vanish(out: Path, limit_s: float = 150.0) -> dict:
    """node1 drops off the network for good at step 40 (its link down, never up: a node powered off resets no
    connection): how long each side lives on, and what it says (the default world.timeout_s, 600 s)."""
    require_cluster()
    run = fresh(out, "vanish")
    job = TwoNodeJob(out, run, job_args(out, run, "--rl.max_steps=300"), torchrun_env("vanish"))
    assert wait_until(lambda: last_step(run) >= 40, 300) is not None, f"never reached step 40: {job.logs}"
    step_down = last_step(run)
    subprocess.run([*CLUSTER, "link", "node1", "down"], check=True)
    t0 = time.monotonic()
    ended = {n: wait_until(lambda n=n: job.procs[n].poll() is not None, limit_s) for n in NODES}
    subprocess.run([*CLUSTER, "link", "node1", "up"], check=True)
    codes = job.wait(time.monotonic() - job.t0 + 30)
    return {
        "link_down_at_step": step_down,
        "ended_after_s": {n: None if e is None else round(e, 1) for n, e in ended.items()},
        "measured_since_down_s": round(time.monotonic() - t0, 1),
        "rc": codes,
        "cause_node0": cause_lines(job.console("node0"), 6),
        "cause_node1": cause_lines(job.console("node1"), 6),
        "last_step": last_step(run),
    }


def quick_failure(out: Path, name: str, env: dict[str, str], node_env: dict | None = None, limit: float = 180) -> dict:
    run = fresh(out, name)
    job = TwoNodeJob(out, run, job_args(out, run), env, node_env)
    codes = job.wait(limit)
    return {
        "rc": codes,
        "ended_s": round(time.monotonic() - job.t0, 1),
        "hung_to_limit": None in codes.values(),
        "cause_node0": cause_lines(job.console("node0")),
        "cause_node1": cause_lines(job.console("node1")),
    }


def part_interface(out: Path) -> dict:
    require_cluster()
    return {
        "no_such_interface": quick_failure(out, "interface-none", torchrun_env("if1", GLOO_SOCKET_IFNAME="ib9")),
        "loopback": quick_failure(out, "interface-lo", torchrun_env("if2", GLOO_SOCKET_IFNAME="lo")),
    }


def part_rendezvous(out: Path) -> dict:
    require_cluster()
    return {
        "address_nobody_has": quick_failure(out, "rdzv-addr", torchrun_env("rz1", rdzv="10.77.0.9:29500")),
        "unresolvable_name": quick_failure(out, "rdzv-name", torchrun_env("rz2", rdzv="node9:29500")),
    }


def part_crash_slurm(out: Path) -> dict:
    """Node1 crashes (every process, its slurmd too) under the SLURM wrapper: SLURM marks it down and requeues the
    job (the wrapper asks for --requeue); the node comes back (its slurmd restarted) and the requeued job runs
    again, resuming from the newest intact checkpoint. Nothing is resubmitted by hand."""
    require_cluster()
    run = fresh(out, "crash-slurm")
    job = sbatch(out, run, "--checkpoint.interval=20", "--rl.max_steps=120")
    assert wait_until(lambda: last_step(run) >= 50, 300) is not None, f"job {job} never reached step 50"
    step = last_step(run)
    t0 = time.monotonic()
    subprocess.run([*CLUSTER, "kill", "node1"], check=True)
    node0_gone = wait_until(lambda: not node_pids("node0"), 120)
    requeued = wait_until(lambda: "Restarts=1" in slurm(["scontrol", "show", "job", job]), 120, every=0.5)
    requeued_s = time.monotonic() - t0
    state = slurm(["scontrol", "show", "job", job])
    ck, _ = newest_intact(run / "checkpoints")
    subprocess.run([*CLUSTER, "revive", "node1"], check=True)
    t1 = time.monotonic()
    done = wait_until(lambda: "JobState=COMPLETED" in slurm(["scontrol", "show", "job", job]), 420, every=1.0)
    text = next(run.parent.glob(f"run-{job}.out")).read_text(errors="replace")
    return {
        "job": job,
        "killed_at_step": step,
        "node0_processes_gone_s": None if node0_gone is None else round(node0_gone, 1),
        "requeued_s": None if requeued is None else round(requeued_s, 1),
        "state_after": re.findall(r"(JobState=\S+|Reason=\S+|Restarts=\S+)", state),
        "survivor_cause": cause_lines(text),
        "slurm_lines": [x for x in text.splitlines() if x.startswith(("srun:", "slurmstepd"))][:6],
        "newest_intact_checkpoint": ck.name if ck else None,
        "requeued_run_completed_s": None if done is None else round(time.monotonic() - t1, 1),
        "resumed": re.findall(r"\[rl\] resumed from [^\n]*", text),
        **summary(run),
    }


def part_scancel(out: Path) -> dict:
    require_cluster()
    run = fresh(out, "scancel")
    job = sbatch(out, run, "--checkpoint.interval=20", "--rl.max_steps=300")
    assert wait_until(lambda: last_step(run) >= 50, 300) is not None, f"job {job} never reached step 50"
    step = last_step(run)
    t0 = time.monotonic()
    slurm(["scancel", job])
    gone = wait_until(lambda: not node_pids("node0") and not node_pids("node1"), 120)
    queue_empty = wait_until(lambda: job_state(job) == "", 60, every=0.5)
    ck, skipped = newest_intact(run / "checkpoints")
    text = next(run.parent.glob(f"run-{job}.out")).read_text(errors="replace")
    return {
        "job": job,
        "cancelled_at_step": step,
        "processes_gone_s": None if gone is None else round(gone, 1),
        "left_queue_s": None if queue_empty is None else round(time.monotonic() - t0, 1),
        "newest_intact_checkpoint": ck.name if ck else None,
        "damaged_skipped": skipped,
        "stop_lines": [line for line in text.splitlines() if re.search(r"SIGTERM|stopp|saved|CANCELLED", line)][:4],
    }


PARTS = {
    "one-node": part_one_node,
    "torchrun": part_torchrun,
    "slurm": part_slurm,
    "crash": part_crash,
    "crash-node0": lambda out: part_crash(out, "node0"),
    "crash-slurm": part_crash_slurm,
    "link": part_link,
    "link-long": part_link_long,
    "vanish": part_vanish,
    "interface": part_interface,
    "rendezvous": part_rendezvous,
    "scancel": part_scancel,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results, logs and runs (outside the repository)")
    p.add_argument("parts", nargs="+", choices=[*PARTS, "table"])
    a = p.parse_args()
    out = a.out.resolve()
    for part in a.parts:
        if part == "table":
            continue
        if part != "one-node" and not (out / "warmstart" / "config.json").is_file():
            sys.exit(f"{out / 'warmstart'} is missing: run the one-node part first (it trains the warm start)")
        t0 = time.monotonic()
        result = PARTS[part](out)
        result["part_s"] = round(time.monotonic() - t0, 1)
        save(out, part, result)


if __name__ == "__main__":
    main()
