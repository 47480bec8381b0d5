"""How many GPUs a node has, asked without initialising CUDA in this process.

A CUDA call in a process (even `torch.cuda.is_available()`, which calls `cudaGetDeviceCount` and so `cuInit`)
initialises the driver; a process forked after that cannot use CUDA. An inference rank starts vLLM, whose engine
core and workers take the GPUs, so that rank must never initialise CUDA itself; yet every rank must agree on the
job's backend, which depends on whether the node has GPUs. NVML (the library behind `nvidia-smi`) answers the count
without touching the CUDA runtime; where NVML cannot answer, a child process asks CUDA and exits.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import torch
import torch.distributed as dist

_CHILD = "import torch; print(torch.cuda.device_count())"


def _count_in_child() -> int:
    """CUDA's own count, from a short-lived child process (this one stays uninitialised)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"counting GPUs in a child process failed: {out.stderr.strip()[-500:]}")
    return int(out.stdout.strip().splitlines()[-1])


@functools.cache
def gpu_count() -> int:
    """GPUs visible to this process (CUDA_VISIBLE_DEVICES applies), never initialising CUDA here: 0 on a CPU build
    of torch, NVML's count where NVML answers, else CUDA's count from a child process."""
    if not torch.cuda._is_compiled():
        return 0
    n = torch.cuda._device_count_nvml()
    return n if n >= 0 else _count_in_child()


def smallest_gpu_gib(own: float | None, group: dist.ProcessGroup | None = None) -> float:
    """The smallest GPU memory (GiB) any rank of `group` reports (collective: a MIN all-reduce of one CPU float, so
    every rank gets the same value); `own`: this rank's GPU (`torch.cuda.get_device_properties(d).total_memory`, on a
    rank that uses CUDA), None for a rank that reports none (an inference rank, which must not touch CUDA: vLLM's
    engines sit on GPUs of the same kind in our layouts). inf when no rank reports one."""
    t = torch.tensor([own if own is not None else float("inf")], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t.item())
