"""The GPU memory the job's "auto" keys plan for: the smallest any rank reports, the same on every rank, over gloo
(the default group of an NCCL job); a rank without a GPU of its own (a vLLM rank) reports none."""

from __future__ import annotations

import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from pipelinerl_fsdp.runtime.gpus import smallest_gpu_gib

OWN = [79.2, None, 39.4]  # a trainer on an 80 GB card, a vLLM rank, a trainer on a 40 GB card


def _rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(OWN))
    try:
        out[rank] = smallest_gpu_gib(OWN[rank])
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_smallest_gpu_any_rank_reports():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, out), nprocs=len(OWN), join=True)
        assert dict(out) == {0: 39.4, 1: 39.4, 2: 39.4}


def test_no_rank_with_a_gpu_reports_infinity():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert smallest_gpu_gib(None) == float("inf")
        assert smallest_gpu_gib(79.25) == 79.25
    finally:
        dist.destroy_process_group()
