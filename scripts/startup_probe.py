"""Start-up of a job whose trainer ranks use CUDA beside a CPU-only inference rank (a vLLM rank's own process), then
one exchange on each process group. Run by `scripts/gpu_check.py` under torchrun with 2 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/startup_probe.py --layout fixed

--layout fixed: the job's own `world.init_world` (a vLLM-engine config: rank 1 stays on CPU).
--layout landed: the calls the job made before the fix: the default group with "cpu:gloo,cuda:nccl" and a
  `device_id` on the trainer (torch then connects NCCL eagerly over every rank, the CPU-only one included), the
  trainer group split from it, a gloo control group. On a GPU this is expected to hang until the time-out.
--device cpu: the same calls without CUDA (the rehearsal on a CPU machine: every line runs, nothing can hang).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def landed(device: torch.device, rank: int, world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The landed world.py's calls (before the fix), for 1 trainer (rank 0) + 1 CPU-only inference rank."""
    on_gpu = device.type == "cuda"
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if on_gpu else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if on_gpu and rank == 0 else None,
    )
    trainer_group = dist.new_group([0])
    dist.new_group([0, 1], backend="gloo") if on_gpu else None  # the control group
    weight_group = dist.new_group([0, 1], backend="gloo")
    dist.new_group([0, 1], backend="gloo")  # rollouts
    return trainer_group, weight_group


def fixed(device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup, torch.device]:
    from pipelinerl_fsdp.configure import load_config
    from pipelinerl_fsdp.job.world import init_world

    cfg = load_config(
        ["--job.stage=rl", "--world.inference_ranks=1", "--inference.engine=vllm", f"--job.device={device.type}"]
    )
    w = init_world(cfg)
    return w.trainer_group, w.weight_group, w.device


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=("fixed", "landed"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = p.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.perf_counter()
    if a.layout == "landed":
        device = torch.device(a.device, 0) if a.device == "cuda" and rank == 0 else torch.device("cpu")
        trainer_group, weight_group = landed(device, rank, world_size)
    else:
        trainer_group, weight_group, device = fixed(torch.device(a.device))
    t_init = time.perf_counter() - t0
    if rank == 0:  # a trainer collective on the trainer's device (NCCL on a GPU)
        x = torch.ones(4, device=device)
        dist.all_reduce(x, group=trainer_group)
        if device.type == "cuda":
            torch.cuda.synchronize()
    header = torch.tensor([1, 7, 3]) if rank == 0 else torch.zeros(3, dtype=torch.long)
    dist.broadcast(header, 0, group=weight_group)  # an update header, as the job sends it
    assert header.tolist() == [1, 7, 3], header
    dist.barrier()
    # the inference rank must not have initialised CUDA (vLLM's processes would inherit a poisoned driver)
    cuda_touched = torch.cuda.is_initialized()
    print(
        f"[probe rank {rank}] layout {a.layout}: init {t_init:.2f} s, device {device}, "
        f"cuda initialised in this process: {cuda_touched}",
        flush=True,
    )
    if rank == 1 and cuda_touched:
        raise SystemExit("the CPU-only inference rank initialised CUDA")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
