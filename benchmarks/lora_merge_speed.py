"""The engines' LoRA merge, timed: what one in-flight update costs an engine to merge every targeted weight
(`models.lora.merged_weight`, one fused `addmm`) against the unfused W0 + s (B A), at SmolLM2-135M's shapes (all
seven linears of its 30 layers, rank 16, fp32, one thread), alternating the two, `--reps` times each.

    python -m benchmarks.lora_merge_speed [--reps 3] [--out benchmarks/results/lora_merge_speed.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.models.lora import merged_weight

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 key/value heads of 64, 30 layers
HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30


def unfused(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The baseline: the product, its scaling and the sum as three separate tensors."""
    return (w0.float() + scaling * (b.float() @ a.float())).to(w0.dtype)


def time_merge(f: Callable, weights: list[tuple[torch.Tensor, ...]]) -> float:
    """Seconds to merge every weight once."""
    t = time.perf_counter()
    for w0, a, b in weights:
        f(w0, a, b, 2.0)  # the result dropped at once, as an engine hands it to its loader
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "lora_merge_speed.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    shapes = [(Q, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, Q), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(o, i, generator=gen), torch.randn(a.rank, i, generator=gen), torch.randn(o, a.rank, generator=gen))
        for o, i in shapes * LAYERS
    ]
    for w0, x, y in weights[:3]:  # the two agree (to fp32 rounding)
        torch.testing.assert_close(merged_weight(w0, x, y, 2.0), unfused(w0, x, y, 2.0), atol=1e-4, rtol=1e-5)
    times: dict[str, list[float]] = {"merged_weight (addmm)": [], "unfused": []}
    for _ in range(a.reps):
        times["merged_weight (addmm)"].append(time_merge(merged_weight, weights))
        times["unfused"].append(time_merge(unfused, weights))
    base = statistics.median(times["unfused"])
    params = sum(o * i for o, i in shapes) * LAYERS
    rows = [
        [
            name,
            len(weights),
            round(params / 1e6, 1),
            round(statistics.median(t) * 1e3),
            round(base / statistics.median(t), 2),
        ]
        for name, t in times.items()
    ]
    report(
        Path(a.out),
        "The engines' LoRA merge per update, SmolLM2-135M shapes, fp32, 1 thread",
        ["merge", "weights", "M params", "ms (median)", "speed-up over unfused"],
        rows,
        {"times_s": times, "rank": a.rank},
    )


if __name__ == "__main__":
    main()
