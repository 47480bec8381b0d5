#!/usr/bin/env bash
# SLURM wrapper: one torchrun agent per node, joined by a c10d rendezvous on the first node.
#   sbatch --nodes 16 --ntasks-per-node 1 --gpus-per-node 8 scripts/slurm_train.sh --config math.toml
# GPUS_PER_NODE (default 8) sets the processes per node; MAX_RESTARTS (default: the config's job.max_restarts)
# the restarts after a failure, each resuming from the newest intact checkpoint. The repository (and the
# output folder) must be on a shared file system and its .venv set up once beforehand (bash scripts/setup_env.sh
# test,gpu).
# Network: gloo carries the default group, rollouts and update headers, NCCL the trainers' collectives and the weight
# buckets; both pick an interface by themselves, which fails where the first one is not the one the nodes share
# (docker bridges, hostnames that resolve to loopback). Set IFNAME (e.g. ib0, eth0) to set NCCL_SOCKET_IFNAME and
# GLOO_SOCKET_IFNAME together, or set those two yourself. vLLM's processes never see torchrun's variables.
#SBATCH --job-name=pipelinerl
#SBATCH --ntasks-per-node=1
#SBATCH --output=slurm-%j.out
# A node that fails puts the job back in the queue (whatever the cluster's JobRequeue default), and the next run
# resumes from the newest intact checkpoint; its log is appended to, so the failed attempt's stays.
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -n "${IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"; fi
# sed reads the whole list: `head -n 1` would close the pipe early, and under pipefail scontrol's SIGPIPE ends the script
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export NNODES="$SLURM_JOB_NUM_NODES" NPROC_PER_NODE="${GPUS_PER_NODE:-8}"
export RDZV_ENDPOINT="${head_node}:${RDZV_PORT:-29500}" RDZV_ID="$SLURM_JOB_ID" SKIP_SETUP=1 PYTHON="${PYTHON:-.venv/bin/python}"
# srun starts one task per node. Which ranks a node gets is the c10d rendezvous's choice, not NODE_RANK's
# (torchrun ignores --node-rank with c10d): nodes are numbered by their hostnames sorted as strings (node10
# before node2), so the trainers (low ranks) are on the first nodes by name and the engines (high ranks) on the
# last. docs/cluster.md runs this wrapper on a real two-node SLURM (scripts/cluster.sh).
srun --kill-on-bad-exit=1 bash -c 'NODE_RANK=$SLURM_NODEID exec bash run_train.sh "$@"' _ "$@"
