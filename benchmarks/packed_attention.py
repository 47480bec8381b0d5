"""Attention over packed documents on one device: the one-kernel path (torch's varlen flash attention over the
packer's offsets, `models/documents.varlen_document_attention`) against the per-document SDPA loop
(`document_attention`), forward + backward of the attention core of the Qwen2.5-0.5B shape (14 query heads, 2 kv
heads, head_dim 64) over one row of documents of mixed lengths up to 8k tokens (an RL mix: short prompts, a
long-tailed completion each).

    python -m benchmarks.packed_attention                  # a GPU: bf16, 32,768 tokens, documents up to 8,192
    python -m benchmarks.packed_attention --device cpu --tokens 512 --max-doc 128 --heads 4 --kv-heads 2 \\
        --head-dim 16 --iters 2                            # the CPU rehearsal (fp32; flash has no CPU kernel)

Agreement: each path's output and q, k, v gradients against an fp32 reference (the loop in fp32, kv heads
expanded), as max |x - ref| / max |ref| per tensor; the one kernel agrees where its worst error is at most twice
the bf16 loop's plus 1e-3 (bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding; both paths round q, k, v and
the output once and accumulate in fp32, in different orders). Timing: the median of `--iters` forward + backward
passes after `--warmup`, CUDA events on a GPU. Host syncs: each path's forward + backward run under
`torch.cuda.set_sync_debug_mode("error")` (GPU only), and so is `Documents.from_positions` (the reference, which
reads positions back); and, under `set_sync_debug_mode("warn")`, a whole training forward + backward of the debug
model with the packer's offsets and log-prob indices, against the same reading positions and mask (`model_packer`
should be "none"). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.models import build_model, documents, flavour_args
from pipelinerl_fsdp.models.documents import Documents, document_attention, varlen_document_attention
from pipelinerl_fsdp.rl.packing import nonzero_index, pack_row

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rl_lengths(tokens: int, max_doc: int, seed: int) -> list[int]:
    """Document lengths filling `tokens` exactly: one of `max_doc`, then prompts of 32-256 tokens each with a
    log-normal completion (median ~600) clipped to the longest document; the last one cut to fit."""
    rng = random.Random(seed)
    lengths = [min(max_doc, tokens)]
    while sum(lengths) < tokens:
        n = rng.randint(32, 256) + int(rng.lognormvariate(6.4, 1.0))
        lengths.append(max(1, min(n, max_doc, tokens - sum(lengths))))
    return lengths


def inputs(t: int, heads: int, kv_heads: int, hd: int, device: torch.device, seed: int) -> Tensors:
    """fp32 q, k, v [1, H, T, hd] in the projections' memory order ([1, T, H, hd])."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, t, h, hd, generator=g).to(device).transpose(1, 2) for h in (heads, kv_heads, kv_heads))


def forward_backward(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], qkv: Tensors, grad):
    """Output and q, k, v gradients of one pass (leaves made from `qkv`)."""
    leaves = [x.detach().requires_grad_() for x in qkv]
    out = attend(*leaves)
    out.backward(grad)
    return [out.detach(), *(x.grad for x in leaves)]


def timed_ms(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def syncs(fn: Callable[[], object], device: torch.device) -> str:
    """'none' when `fn` runs without a host sync on the GPU, else the first sync's message (GPU only)."""
    if device.type != "cuda":
        return "n/a (cpu)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return f"sync: {str(e).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def model_syncs(device: torch.device, dtype: torch.dtype, with_packer: bool) -> str:
    """Host syncs in a training forward + backward of the debug model on packed rows: with the packer's offsets and
    indices (`documents`, `logprob_index`) or with the model reading them from positions and mask (GPU only)."""
    if device.type != "cuda":
        return "n/a (cpu)"
    args = flavour_args("debug")
    model = build_model(args, device=device, dtype=dtype, seed=0)
    g = torch.Generator().manual_seed(0)
    row = pack_row([torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (40, 7, 90, 25)], device)
    mask = [float(i % 3 != 0) for i in range(row.targets.shape[1])]
    kw: dict = {"logprob_positions": torch.tensor(mask, device=device)[None]}
    if with_packer:
        kw.update(documents=row.documents, logprob_index=nonzero_index(mask, device))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            logp, ent = model(row.input_ids, row.position_ids, targets=row.targets, **kw)
            (logp.sum() + ent.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found = [str(w.message).splitlines()[0][:60] for w in caught if "synchroniz" in str(w.message)]
    return "none" if not found else f"{len(found)}: {found[0]}"


def worst_error(xs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max(float((x.float() - r).abs().max() / r.abs().max()) for x, r in zip(xs, refs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--max-doc", type=int, default=8192)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "packed_attention.json")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    lengths = rl_lengths(a.tokens, a.max_doc, a.seed)
    docs = Documents.from_lengths([lengths], device)
    gqa = a.heads != a.kv_heads
    group = a.heads // a.kv_heads
    qkv32 = inputs(a.tokens, a.heads, a.kv_heads, a.head_dim, device, a.seed)
    grad32 = torch.randn(1, a.heads, a.tokens, a.head_dim, generator=torch.Generator().manual_seed(a.seed + 1))
    grad32 = grad32.to(device)
    qkv = tuple(x.to(dtype) for x in qkv32)
    grad = grad32.to(dtype)

    def reference(q, k, v):  # fp32, kv heads expanded in the graph (SDPA's fast fp32 kernels take no GQA)
        return document_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), docs, False)

    def loop(q, k, v):
        return document_attention(q, k, v, docs, gqa)

    def one_kernel(q, k, v):
        return varlen_document_attention(q, k, v, docs, gqa)

    def native_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        """torch's kernel handed k, v with their own (fewer) heads and no `enable_gqa` keyword: what a torch whose
        varlen_attn lacks the flag (2.10/2.11) would do natively, instead of `call_varlen`'s expansion."""
        return documents.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size)

    def one_kernel_native(q, k, v):
        return varlen_document_attention(q, k, v, docs, gqa, kernel=native_gqa)

    ref = forward_backward(reference, qkv32, grad32)
    got = {"loop": forward_backward(loop, qkv, grad)}
    try:
        got["varlen"] = forward_backward(one_kernel, qkv, grad)
        varlen_status = "ok"
    except (NotImplementedError, RuntimeError) as e:  # CPU: flash has no CPU kernel
        varlen_status = f"unavailable on {device.type}: {type(e).__name__}"
    native_status = "not run (no GQA or no kernel)"
    if gqa and "varlen" in got:  # GQA without expanding k, v: the evidence for dropping the expansion on 2.11
        try:
            got["varlen_native_gqa"] = forward_backward(one_kernel_native, qkv, grad)
            native_status = "ok"
        except (RuntimeError, TypeError, ValueError) as e:
            native_status = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    err = {name: worst_error(v, ref) for name, v in got.items()}
    agree = err["varlen"] <= 2 * err["loop"] + 1e-3 if "varlen" in err else None

    ms, peak_gib = {}, {}
    for name, attend in (("loop", loop), ("varlen", one_kernel)):
        if name not in got:
            continue
        if device.type == "cuda":  # the path's own memory: its peak above what the part holds already (inputs,
            torch.cuda.reset_peak_memory_stats(device)  # gradients, the references, the other paths' results)
            held = torch.cuda.memory_allocated(device)
        ms[name] = timed_ms(lambda attend=attend: forward_backward(attend, qkv, grad), a.iters, a.warmup, device)
        if device.type == "cuda":
            peak_gib[name] = round((torch.cuda.max_memory_allocated(device) - held) / 2**30, 3)
    positions = torch.zeros(1, 8, dtype=torch.long, device=device)
    sync = {
        "loop": syncs(lambda: forward_backward(loop, qkv, grad), device),
        "from_positions": syncs(lambda: Documents.from_positions(positions), device),
    }
    sync["model_packer"] = model_syncs(device, dtype, with_packer=True)
    sync["model_positions"] = model_syncs(device, dtype, with_packer=False)
    if "varlen" in got:
        sync["varlen"] = syncs(lambda: forward_backward(one_kernel, qkv, grad), device)

    data = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim},
        "attn_tokens": a.tokens,
        "attn_docs": len(lengths),
        "lengths": lengths,
        "varlen_status": varlen_status,
        "loop_err": round(err["loop"], 6),
        "varlen_err": round(err["varlen"], 6) if "varlen" in err else None,
        "varlen_vs_loop": round(worst_error(got["varlen"], [x.float() for x in got["loop"]]), 6)
        if "varlen" in got
        else None,
        "agree": agree,
        "varlen_native_gqa_status": native_status,
        "varlen_native_gqa_err": round(err["varlen_native_gqa"], 6) if "varlen_native_gqa" in err else None,
        "loop_ms": round(ms["loop"], 3),
        "varlen_ms": round(ms["varlen"], 3) if "varlen" in ms else None,
        "speedup": round(ms["loop"] / ms["varlen"], 2) if "varlen" in ms else None,
        "peak_gib": peak_gib,
        "syncs": sync,
    }
    columns = ["path", "status", "fwd+bwd ms", "worst error vs fp32", "host syncs"]
    rows = [
        ["per-document loop", "ok", data["loop_ms"], data["loop_err"], sync["loop"]],
        ["one varlen kernel", varlen_status, data["varlen_ms"], data["varlen_err"], sync.get("varlen", "")],
        ["one varlen kernel, kv heads as they are", native_status, "", data["varlen_native_gqa_err"], ""],
    ]
    title = f"Packed attention, {len(lengths)} documents in {a.tokens} tokens ({data['dtype']}, {data['device']})"
    report(a.out, title, columns, rows, data)
    if agree is False:
        raise SystemExit(f"the one kernel disagrees with the loop: {err}")


if __name__ == "__main__":
    main()
