"""Weight-update cost against model size, next to a plain copy of the same bytes over the same link.

Run (2 processes: rank 0 = FSDP2 trainer, rank 1 = engine; gloo on CPU, NCCL on GPU):
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.weight_sync \
        --flavours debug,small --repeats 5 --out benchmarks/results/weight_sync.json

For each model: `sender_peak_mb` / `receiver_peak_mb` (the peak extra host memory of each side, measured from before
the sender / bound receiver exists through the first update: send buffers, the bound receiver's transient bucket),
`gather` (DTensor full_tensor on the trainer), `push` (sender: whole update), `pause` (receiver:
header seen -> last bucket written into the engine's parameters; what an engine stalls for), and two baselines:
`plain_bcast` (one broadcast of a flat tensor of the same bytes on the same group) and `memcpy` (a local copy).
`pause_over_plain` is the median over rounds of pause / plain_bcast, each round running the update and the plain
broadcast back to back (the plain broadcast alone varies by tens of percent from run to run on a shared machine).
The target (docs/performance.md): pause within 1.3x of plain_bcast. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.job.world import init_world
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.runtime.host_memory import PeakAnon
from pipelinerl_fsdp.training.parallelize import apply_fsdp
from pipelinerl_fsdp.transport.weights import BucketLayout, WeightReceiver, WeightSender, slot_sizes


def median_ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def bench(flavour: str, repeats: int, world, bucket_mb: int, plain_group) -> dict:
    args = flavour_args(flavour, vocab_size=32768 if flavour == "small" else 64)
    dtype = torch.float32
    dev = world.device
    model = build_model(args, device=dev, dtype=dtype, seed=0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    group, src = world.weight_group, world.trainer_ranks[0]
    res: dict[str, list[float]] = {"gather": [], "push": [], "pause": [], "plain_bcast": [], "memcpy": [], "ratio": []}
    send_buffers = 0
    # peak extra host memory of each side: from before the sender / receiver exists through the first update
    mem = PeakAnon()
    if world.is_trainer:
        apply_fsdp(model, world.trainer_mesh, dtype, dtype)
        flat = torch.randn(nbytes // 4, device=dev)
        mem.__enter__()
        sender = WeightSender(model, group, src, world.is_main, dtype, dev, bucket_mb * 1024**2)
        send_buffers = sum(b.numel() * b.element_size() for b in sender._flat)
        for v in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            stats = sender.push(v + 1)
            if v == 0:
                mem.__exit__(None, None, None)
            if v:  # the first round warms up
                res["push"].append(time.perf_counter() - t0)
                res["gather"].append(stats.gather_s)
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(flat, src, group=plain_group)
            if v:
                res["plain_bcast"].append(time.perf_counter() - t0)
        sender.stop()
    else:
        params = dict(model.named_parameters())
        flat = torch.zeros(nbytes // 4, device=dev)
        other = torch.zeros_like(flat)
        mem.__enter__()
        rx = WeightReceiver([(n, p.shape) for n, p in params.items()], group, src, dtype, dev, bucket_mb * 1024**2)
        rx.bind(params)
        for v in range(repeats + 1):
            dist.barrier()
            while not rx.pending():  # what the engine does between decode steps
                time.sleep(0.0002)
            t0 = time.perf_counter()
            rx.receive()
            if v == 0:
                mem.__exit__(None, None, None)
            if v:
                res["pause"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(flat, src, group=plain_group)
            if v:
                res["plain_bcast"].append(time.perf_counter() - t0)
                res["ratio"].append(res["pause"][-1] / res["plain_bcast"][-1])
            t0 = time.perf_counter()
            other.copy_(flat)
            if v:
                res["memcpy"].append(time.perf_counter() - t0)
        rx.receive()  # the stop
    # Combine: the trainer knows gather/push, the engine pause/memcpy; both measured plain_bcast.
    mine = torch.tensor([median_ms(res[k]) if res[k] else 0.0 for k in res], dtype=torch.float64)
    mine[list(res).index("ratio")] /= 1000  # a ratio, not a time
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    peaks = torch.zeros(2, dtype=torch.float64)
    peaks[0 if world.is_trainer else 1] = mem.grown / 1e6
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    row = dict(zip([f"{k}_ms" for k in res if k != "ratio"], mine.tolist()))
    ratio = mine[list(res).index("ratio")].item()
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    sizes = BucketLayout(shapes, dtype, bucket_mb * 1024**2).sizes
    row.update(
        # extra memory of the sync: the sender's send buffers; a vLLM worker's receive buffers (the same bound)
        sender_buffers_mb=round(send_buffers / 1e6, 1),
        sender_peak_mb=round(peaks[0].item(), 1),
        receiver_peak_mb=round(peaks[1].item(), 1),
        worker_buffers_mb=round(sum(slot_sizes(sizes)) * 4 / 1e6, 1),
        flavour=flavour,
        params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        mbytes=round(nbytes / 1e6, 1),
        # per round: the update and the plain broadcast run back to back, so both see the same machine state
        pause_over_plain=ratio,
        pause_mb_per_s=nbytes / 1e6 / max(row["pause_ms"] / 1000, 1e-9),
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavours", default="debug,small")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "weight_sync.json"))
    a = ap.parse_args()
    world = init_world(load_config(["--world.inference_ranks=1", "--job.threads_per_rank=1"]))
    # The baseline needs its own group over the same two ranks: the engine always has a header receive posted on
    # the weight group, which would swallow any other broadcast there.
    plain_group = dist.new_group([world.trainer_ranks[0], *world.inference_ranks])
    rows = [bench(f, a.repeats, world, a.bucket_mb, plain_group) for f in a.flavours.split(",")]
    if world.rank == 0:
        cols = [
            "flavour",
            "params_m",
            "mbytes",
            "gather_ms",
            "push_ms",
            "pause_ms",
            "plain_bcast_ms",
            "memcpy_ms",
            "pause_over_plain",
            "pause_mb_per_s",
            "sender_buffers_mb",
            "worker_buffers_mb",
            "sender_peak_mb",
            "receiver_peak_mb",
        ]
        report(
            Path(a.out),
            "Weight-update pause against a plain broadcast and a memcpy of the same bytes",
            cols,
            [[r[c] for c in cols] for r in rows],
            {"device": str(world.device), "backend": world.backend, "bucket_mb": a.bucket_mb, "rows": rows},
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
