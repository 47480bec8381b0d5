"""Where a CPU vLLM engine's time goes, against a plain batched generate loop of the same requests on the same core.

Run (no torchrun; vLLM from the `cpu` extra; the long-tail task's warm start, which
`python benchmarks/learning_speed.py --task chain_sum` makes once):
    python benchmarks/engine_overhead.py --out benchmarks/results/engine_overhead.json

Every engine gets the same requests: `--requests` prompts of the long-tail task (2-12 two-digit terms) per round,
all submitted at once and run until the last one stops (EOS or `--max-tokens`), as a conventional-mode generation
batch does; `--rounds` measured rounds after a warm-up. Everything is pinned to one core (`--core`), as an inference
rank of the default job is. Engines:
- `plain`: the project's pure-PyTorch engine (`ReferenceEngine`: one process, batched decode with a KV cache).
- `vllm`: the job's vLLM engine as the job runs it (no detokenisation).
- `vllm+text`: the same with vLLM's detokenisation on (the job's setting before this benchmark).
For vLLM, the CPU seconds of each of its processes over the measured rounds: the client (this process: vLLM's
output processing, detokenisation, our loop), the engine core (scheduling, serialisation, the hop to the worker)
and the worker (the model). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
from pathlib import Path

import psutil
import torch
from engines import run_engine
from harness import RESULTS, report

from pipelinerl_fsdp.inference.placement import VLLMPlacement
from pipelinerl_fsdp.tasks.arithmetic import ChainSum, ChainSumConfig
from pipelinerl_fsdp.tokenizer import load_tokenizer


def cpu_seconds(proc: psutil.Process) -> dict[str, float]:
    """User + system CPU seconds of `proc` and each of its live descendants, by role."""
    out = {"client": sum(proc.cpu_times()[:2])}
    for child in proc.children(recursive=True):
        try:
            title = " ".join(child.cmdline())  # vLLM titles its processes "VLLM::EngineCore", "VLLM::Worker..."
            role = "worker" if "Worker" in title else "engine core" if "EngineCore" in title else "other"
            out[role] = out.get(role, 0.0) + sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def roles(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in after if after[k] - before.get(k, 0.0) > 0.01}


def bench(kind: str, model: Path, prompts: list[list[int]], a: argparse.Namespace, stops: list[int]) -> dict:
    import pipelinerl_fsdp.inference.vllm_engine as ve

    max_len = max(map(len, prompts)) + a.max_tokens
    if kind == "plain":
        from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
        from pipelinerl_fsdp.models.hf_io import load_hf_model

        net = load_hf_model(model, torch.device("cpu"), torch.float32)
        engine = ReferenceEngine(net, a.requests, max_len, stops, 1.0, 1.0, 0)
    else:
        original = ve.sampling_params
        if kind == "vllm+text":  # the engine's sampling parameters as they were, detokenisation on
            ve.sampling_params = functools.partial(original, detokenize=True)
        kv = ve.kv_cache_gib_needed(ve.read_model_args(model), a.requests, max_len, 4)
        engine = ve.VLLMEngine(
            model,
            a.requests,
            max_len,
            1.0,
            1.0,
            0,
            "float32",
            VLLMPlacement(str(a.core), None),
            kv,
            stop_token_ids=stops,
        )
    try:
        n = a.requests
        run_engine(engine, prompts[:8], a.max_tokens, 10**6)  # warm-up
        me = psutil.Process()
        c0 = cpu_seconds(me)
        rates, tokens, wall = [], 0, 0.0
        for k in range(a.rounds):
            t, s = run_engine(engine, prompts[(k + 1) * n : (k + 2) * n], a.max_tokens, k * n)
            rates.append(t / s)
            tokens, wall = tokens + t, wall + s
        cpu = roles(c0, cpu_seconds(me))
    finally:
        if kind != "plain":
            engine.close()
            ve.sampling_params = original
    return {
        "engine": kind,
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(statistics.median(rates)),
        "tokens_per_s_range": [round(min(rates)), round(max(rates))],
        "cpu_s": cpu,
        "cpu_ms_per_1k_tokens": {k: round(1000 * v / tokens * 1000, 1) for k, v in cpu.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("outputs/warmstart/chain_sum-debug"))
    ap.add_argument("--requests", type=int, default=128, help="requests per round (the preset's batch)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    ap.add_argument("--engines", default="plain,vllm,vllm+text")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_overhead.json")
    a = ap.parse_args()
    if not (a.model / "config.json").is_file():
        raise SystemExit(
            f"--model {a.model}: no HF model folder there; `python benchmarks/learning_speed.py --task chain_sum` "
            "makes the long-tail warm start once (or pass another folder)"
        )
    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    task = ChainSum(ChainSumConfig(digits=2, min_terms=2, max_terms=12, max_new_tokens=a.max_tokens))
    tok = load_tokenizer(a.model)
    rng = random.Random(0)
    prompts = [
        tok(task.sample(rng).prompt, add_special_tokens=False)["input_ids"] for _ in range(a.requests * (a.rounds + 1))
    ]
    rows = [bench(kind, a.model, prompts, a, [tok.eos_token_id]) for kind in a.engines.split(",")]
    plain = next((r["tokens_per_s"] for r in rows if r["engine"] == "plain"), None)
    print(
        f"{a.rounds} rounds of {a.requests} long-tail requests (<= {a.max_tokens} tokens) on core {a.core}; "
        "tokens/s: median (min-max) over rounds; CPU ms per 1k tokens by process"
    )
    table = []
    for r in rows:
        ms = r["cpu_ms_per_1k_tokens"]
        lo, hi = r["tokens_per_s_range"]
        vs_plain = round(r["tokens_per_s"] / plain, 2) if plain else "-"
        table.append([r["engine"], f"{r['tokens_per_s']} ({lo}-{hi})", vs_plain] + [
            ms.get(k, "-") for k in ("client", "engine core", "worker")])  # fmt: skip
    report(
        a.out,
        "Engine overhead: tokens/s of vLLM through our engine against plain vLLM (CPU ms per 1k tokens by process)",
        ["engine", "tokens/s", "vs plain", "client", "engine core", "worker"],
        table,
        {"settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows},
    )


if __name__ == "__main__":
    main()
