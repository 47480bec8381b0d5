"""The launch scripts build the torchrun command lines users rely on: run_train.sh on one node, and the SLURM
wrapper on every node of an allocation (a fake SLURM: `scontrol` and `srun` stand-ins on PATH, and a Python
stand-in that prints the torchrun line instead of starting it)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def fake_python(tmp: Path) -> Path:
    # the config query runs for real; the network check and the torchrun launch are printed
    return executable(
        tmp / "python",
        f'#!/usr/bin/env bash\nif [ "$2" = pipelinerl_fsdp.launch ]; then exec {sys.executable} "$@"; fi\n'
        'if [ "$2" = pipelinerl_fsdp.runtime.network ]; then echo "NETCHECK node=${NODE_RANK:-0} $3"; exit 0; fi\n'
        'echo "TORCHRUN node=${NODE_RANK:-0} $*"\n',
    )


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_run_train_passes_max_restarts_from_the_config_or_the_environment(tmp_path):
    env = {"SKIP_SETUP": "1", "PYTHON": str(fake_python(tmp_path)), "PYTHONPATH": str(ROOT)}
    r = run(["bash", "run_train.sh", "--config", "arithmetic", "--job.max_restarts=2"], env)
    assert r.returncode == 0, r.stderr
    assert "--standalone --nnodes 1 --nproc-per-node 2 --max-restarts 2 run_train.py --config arithmetic" in r.stdout
    r = run(["bash", "run_train.sh", "--config", "arithmetic"], {**env, "MAX_RESTARTS": "5"})
    assert "--max-restarts 5 run_train.py" in r.stdout


def test_run_train_stops_on_a_bad_config_before_torchrun(tmp_path):
    env = {"SKIP_SETUP": "1", "PYTHON": str(fake_python(tmp_path)), "PYTHONPATH": str(ROOT)}
    r = run(["bash", "run_train.sh", "--config", "arithmetic", "--rl.attempts=0"], env)
    assert r.returncode != 0 and "TORCHRUN" not in r.stdout
    assert "rl.attempts = 0 must be" in r.stderr


def test_slurm_wrapper_starts_one_agent_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "scontrol", '#!/usr/bin/env bash\nprintf "gpu-a\\ngpu-b\\n"\n')
    # srun: its options dropped, the command run once per node with that node's SLURM_NODEID
    executable(
        bin_dir / "srun",
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done\n',
    )
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": str(fake_python(tmp_path)),
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }
    # the launcher checks the data files before anything starts: real ones (math.toml's are placeholders)
    data = ["--task.train_files=['data/math/orz.parquet']", "--task.eval_files=['data/math/orz_saved']"]
    r = run(["bash", "scripts/slurm_train.sh", "--config", "math", f"--model.path={tmp_path}", *data], env)
    assert r.returncode == 0, r.stderr
    # each node checks the rendezvous host and its interface before its torchrun starts
    checks = [x for x in r.stdout.splitlines() if x.startswith(("NETCHECK", "TORCHRUN"))]
    assert checks[0::2] == ["NETCHECK node=0 gpu-a:29500", "NETCHECK node=1 gpu-a:29500"], r.stdout
    lines = [x for x in r.stdout.splitlines() if x.startswith("TORCHRUN")]
    assert len(lines) == 2, r.stdout
    for node, line in enumerate(lines):
        assert line == (
            f"TORCHRUN node={node} -m torch.distributed.run --nnodes 2 --nproc-per-node 8 --max-restarts 3 "
            f"--node-rank {node} --rdzv-backend c10d --rdzv-endpoint gpu-a:29500 --rdzv-id 4242 run_train.py "
            f"--config math --model.path={tmp_path} {' '.join(data)}"
        )


def test_tests_and_benchmarks_start_a_job_with_one_torchrun_command():
    """`pipelinerl_fsdp.runtime.torchrun`: a fresh local rendezvous, restarts, `-m` for a module, the repository first
    on PYTHONPATH, the thread count."""
    from pipelinerl_fsdp.runtime.torchrun import ENTRY_POINT, REPO, job_command, torchrun_command

    cmd, env = torchrun_command(2, "benchmarks.vllm_update", "--flavour", "debug", module=True, threads=3)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert cmd[cmd.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert cmd[-4:] == ["-m", "benchmarks.vllm_update", "--flavour", "debug"]
    assert env["OMP_NUM_THREADS"] == "3" and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    cmd, _ = job_command(1, "--config", "arithmetic", max_restarts=1)
    assert cmd[-3:] == [str(ENTRY_POINT), "--config", "arithmetic"] and "-m" not in cmd[3:]
    assert cmd[cmd.index("--max-restarts") + 1] == "1" and ENTRY_POINT == ROOT / "run_train.py"
