"""The engines' LoRA merge, timed: what one in-flight update costs an engine, through the engine's own code.

Two measurements over every targeted weight of a model shape (--flavour: SmolLM2-135M by default, or a project
flavour such as qwen2.5-7b), rank --rank, all seven linears of every layer:

1. The merge formula alone: `models.lora.merged_weight` (one fused `addmm`) against the unfused W0 + s (B A),
   alternating the two, --reps times each after one warm-up (W0 on the device).
2. One update as an engine runs it (--base device, host or both): an `inference.lora_merge.AdapterMerge` over the
   shape's adapter layout (`models.lora.adapter_layout`) with vLLM's fused groups (`VLLM_PACKED`), the pushed
   factors fp32 on the device (A uniform as PEFT's init, B small random), its output consumed as a loader does:
   each yielded weight copied into a preallocated destination of the engine's dtype on the device (slices of fused
   q/k/v and gate/up parameters, as vLLM's loaders narrow them). W0 is kept on the device (`device`) or in host
   memory (`host`: pinned where the device is CUDA, as `lora.engine_base = "host"` places it:
   `inference.lora_merge.place_base`; `AdapterMerge` moves each W0 to the factors' device,
   non-blocking, as it merges it). Warm-up 1, then the median of --reps updates; CUDA events on a GPU,
   time.perf_counter on CPU.

Bounds printed beside each update (ms, lower bounds at the measured bandwidths):
- `traffic_bound_ms`: the device memory traffic of the update over the device's measured copy bandwidth (one
  large device-to-device `copy_`, read + write bytes over its time). Per targeted weight of n elements in the engine
  dtype of e bytes (fp32 factors of rank r, in + out = k): the upcast W0 -> fp32 (e + 4, none when e = 4), `addmm`
  copying that input into its output (8) then the GEMM with beta = 1 reading and writing it (8, + 4 r k for the
  factors; torch's out-of-place addmm with a 2-D input does both passes, an assumption the measurement tests), the
  downcast (4 + e, none when e = 4), the loader's copy into the destination (2 e): 24 + 4 e bytes
  when e = 2 (32 in bf16), 24 when e = 4; an untargeted fused sibling (fewer --targets) its loader copy, 2 e; with
  `host`, the H2D copy's device write, e per element, besides.
- `h2d_bound_ms` (`host` on CUDA): the bytes of W0 moved to the device (n e per weight) over the measured pinned
  host-to-device bandwidth (one large pinned copy).

    python -m benchmarks.lora_merge_speed [--reps 3]                       # CPU: SmolLM2-135M, fp32, 1 thread
    python -m benchmarks.lora_merge_speed --device cuda --flavour qwen2.5-7b --base device,host   # GPU: bf16
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from benchmarks.rl_step_speed import model_shape
from pipelinerl_fsdp.config import LORA_TARGETS, LoRAConfig
from pipelinerl_fsdp.inference.lora_merge import (
    VLLM_PACKED,
    AdapterMerge,
    fused_module_name,
    fused_siblings,
    place_base,
)
from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.models.decoder import Transformer
from pipelinerl_fsdp.models.lora import adapted_weight_name, adapter_layout, merged_weight

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def unfused(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The baseline: the product, its scaling and the sum as three separate tensors."""
    return (w0.float() + scaling * (b.float() @ a.float())).to(w0.dtype)


def timed(f: Callable[[], object], device: torch.device) -> float:
    """Seconds `f` takes on the device: CUDA events on a GPU, perf_counter on CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        f()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def merge_all(f: Callable, weights: list[tuple[torch.Tensor, ...]]) -> None:
    """Merge every weight once, each result dropped at once (as an engine hands it to its loader)."""
    for w0, a, b in weights:
        f(w0, a, b, 2.0)


def copy_bandwidth(device: torch.device, host: bool, gib: float) -> float:
    """Bytes/s of one large copy, the best of 3: pinned host -> device (`host`, CUDA) counting the bytes moved, or
    device -> device counting the bytes read and written."""
    n = int(gib * 2**30)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    src = torch.ones(n, dtype=torch.uint8, pin_memory=True) if host else torch.ones(n, dtype=torch.uint8, device=device)
    best = min(timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(3))
    return n * (1 if host else 2) / best


def weight_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Every weight's shape for a model of `args` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {n: p.shape for n, p in Transformer(args).named_parameters()}


def destinations(
    writes: list[str], shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """The serving model's weights an update writes, as vLLM holds them: one tensor per fused module (q/k/v,
    gate/up: their members' rows stacked in `VLLM_PACKED` order), each HF weight a row slice of it."""
    out: dict[str, torch.Tensor] = {}
    for module in dict.fromkeys(fused_module_name(w, VLLM_PACKED) for w in writes):
        first = next(w for w in writes if fused_module_name(w, VLLM_PACKED) == module)
        members = fused_siblings(first, VLLM_PACKED)
        rows = [shapes[m][0] for m in members]
        fused = torch.empty(sum(rows), shapes[first][1], dtype=dtype, device=device)
        for m, part in zip(members, fused.split(rows)):
            out[m] = part
    return out


def traffic_bytes(merge: AdapterMerge, shapes: dict[str, torch.Size], e: int, rank: int, host: bool) -> int:
    """The device memory traffic of one update (the module docstring's estimate)."""
    total = 0
    for w in merge.writes:
        n = shapes[w].numel()
        if w in merge.targets:
            casts = 0 if e == 4 else 2 * (e + 4)
            total += n * (casts + 16 + 2 * e) + 4 * rank * sum(shapes[w])
        else:
            total += 2 * e * n
        total += e * n if host else 0
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--flavour", default="smollm2-135m", help="a shape: smollm2-135m or a project flavour")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the engine's (W0's) dtype: bfloat16 on "
                   "cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--base", default="device", help="where W0 is kept: device, host, or both (device,host)")
    p.add_argument("--targets", default=",".join(LORA_TARGETS), help="the targeted linears (all seven)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--out", default=str(RESULTS / "lora_merge_speed.json"))
    a = p.parse_args()
    bases = a.base.split(",")
    if set(bases) - {"device", "host"}:
        raise SystemExit(f"--base: device, host or both, not {a.base}")
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[a.dtype or ("bfloat16" if cuda else "float32")]
    e = dtype.itemsize
    if not cuda:
        torch.set_num_threads(a.threads)
    args = model_shape(a.flavour, None)
    lora = LoRAConfig(enabled=True, rank=a.rank, alpha=32.0, target_modules=a.targets.split(","))
    layout = adapter_layout(args, lora)
    shapes = weight_shapes(args)
    gen = torch.Generator(device=device).manual_seed(0)
    # the pushed factors, fp32 on the device, in push order (A uniform in +-1/sqrt(in) as PEFT's init, B small)
    pairs = []
    for name, shape in layout:
        t = torch.rand(shape, generator=gen, device=device) * 2 - 1
        pairs.append((name, t / math.sqrt(shape[1]) if ".lora_A." in name else t * 1e-3))
    merge = AdapterMerge({w: torch.empty(0) for w in shapes}, lora.scaling, [n for n, _ in pairs], VLLM_PACKED)
    w0_device = {w: torch.randn(shapes[w], generator=gen, device=device).to(dtype) for w in merge.writes}
    dest = destinations(merge.writes, shapes, dtype, device)
    w0_gib = sum(t.numel() * e for t in w0_device.values()) / 2**30

    # 1. the formula alone, over the targeted weights with W0 on the device
    factors = dict(pairs)
    weights = [
        (w0_device[adapted_weight_name(n)], factors[n], factors[n.replace(".lora_A.", ".lora_B.")])
        for n in factors
        if ".lora_A." in n
    ]
    for w0, x, y in weights[:3]:  # the two agree (to the rounding of the engine's dtype)
        tol = {"atol": 1e-4, "rtol": 1e-5} if e == 4 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(merged_weight(w0, x, y, 2.0), unfused(w0, x, y, 2.0), **tol)
    formulas = {"merged_weight (addmm)": merged_weight, "unfused": unfused}
    times: dict[str, list[float]] = {k: [] for k in formulas}
    for rep in range(a.reps + 1):  # the first is a warm-up
        for name, f in formulas.items():
            s = timed(lambda f=f: merge_all(f, weights), device)
            times[name] += [s] if rep else []
    base = statistics.median(times["unfused"])
    params = sum(w0.numel() for w0, _, _ in weights)
    rows = [
        [name, len(weights), round(params / 1e6, 1), round(statistics.median(t) * 1e3, 1),
         round(base / statistics.median(t), 2)] + [None] * 5
        for name, t in times.items()
    ]  # fmt: skip

    # 2. one update through AdapterMerge, W0 on the device or in host memory
    d2d = copy_bandwidth(device, False, 1.0 if cuda else 0.25)
    h2d = copy_bandwidth(device, True, 1.0) if cuda and "host" in bases else None
    updates = []
    for where in bases:
        w0 = place_base(w0_device, where, device)  # the engine's own placement: host memory pinned on CUDA
        engine = AdapterMerge(w0, lora.scaling, [n for n, _ in pairs], VLLM_PACKED)

        def update(engine: AdapterMerge = engine) -> None:
            for name, weight in engine(pairs):
                dest[name].copy_(weight, non_blocking=True)

        timed(update, device)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        secs = [timed(update, device) for _ in range(a.reps)]
        for w0_, x, y in weights[:3]:  # what was loaded is the engine's merged weight, exactly
            w = next(n for n, t in w0_device.items() if t is w0_)
            torch.testing.assert_close(dest[w], merged_weight(w0_, x, y, lora.scaling), atol=0, rtol=0)
        moved = sum(t.numel() * e for t in w0.values()) if where == "host" and cuda else 0
        traffic = traffic_bytes(engine, shapes, e, a.rank, moved > 0)
        updates.append(
            {
                "base": where,
                "weights_written": len(engine.writes),
                "w0_gib": round(w0_gib, 3),
                "ms": round(statistics.median(secs) * 1e3, 2),
                "ms_min": round(min(secs) * 1e3, 2),
                "traffic_gb": round(traffic / 1e9, 2),
                "traffic_bound_ms": round(traffic / d2d * 1e3, 2),
                "h2d_bound_ms": round(moved / h2d * 1e3, 2) if h2d and moved else None,
                "peak_temp_gib": round((torch.cuda.max_memory_allocated(device) - before) / 2**30, 3) if cuda else None,
            }
        )
        names = {"device": "AdapterMerge update, W0 on the device", "host": "AdapterMerge update, W0 in host memory"}
        rows.append(
            [
                names[where],
                len(engine.writes),
                round(sum(t.numel() for t in w0.values()) / 1e6, 1),
                updates[-1]["ms"],
                None,
                round(w0_gib, 3),
                updates[-1]["traffic_gb"],
                updates[-1]["traffic_bound_ms"],
                updates[-1]["h2d_bound_ms"],
                updates[-1]["peak_temp_gib"],
            ]
        )
        del w0, engine
    label = f"{a.flavour}, rank {a.rank}, {str(dtype).removeprefix('torch.')}, {a.device}"
    label += f", {torch.cuda.get_device_name(device)}" if cuda else f", {a.threads} thread(s)"
    report(
        Path(a.out),
        f"The engines' LoRA merge per update ({label})",
        ["merge", "weights", "M params", "ms (median)", "speed-up over unfused", "W0 GiB", "traffic GB",
         "traffic bound ms", "H2D bound ms", "peak temp GiB"],
        rows,
        {
            "times_s": times,
            "rank": a.rank,
            "flavour": a.flavour,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "d2d_gb_s": round(d2d / 1e9, 1),
            "h2d_gb_s": round(h2d / 1e9, 1) if h2d else None,
            "updates": updates,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
