"""Generation throughput: the job's vLLM engine (AsyncLLM in its own processes) vs the pure-PyTorch reference engine.

Run (no torchrun; vLLM from the `cpu` extra on this machine):
    python -m benchmarks.engines --flavours debug,small --prompts 64 --max-tokens 64 \
        --out benchmarks/results/engines.json

Both engines get the same random model (the flavour's body with the character vocabulary, saved as an HF folder),
the same prompts and sampling (temperature 1, no stop token, so both generate prompts x max_tokens tokens). The
in-job cost of a weight update is measured by benchmarks/vllm_update.py. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.placement import VLLMPlacement
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer


def run_engine(engine, prompts: list[list[int]], max_tokens: int, first_id: int) -> tuple[int, float]:
    reqs = [Request(first_id + i, p, max_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add(r)
    while engine.num_unfinished():
        engine.step()
    return sum(len(r.tokens) for r in reqs), time.perf_counter() - t0


def bench(name: str, n_prompts: int, max_tokens: int, threads: int, work: Path, gpu: bool = False) -> list[dict]:
    from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine

    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args(name, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = build_model(args, seed=0).eval()
    folder = work / name
    save_hf_folder(folder, args, model.state_dict())
    tok.save_pretrained(str(folder))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (8,), generator=gen).tolist() for _ in range(n_prompts)]
    max_len = 8 + max_tokens + 8
    cores = f"0-{threads - 1}"
    rows = []
    # Both engines built by hand, not through `factory.generation_engine`: the reference engine runs the random
    # model in memory (no folder to load), and vLLM ignores EOS (`ignore_eos`, no config key) so that both generate
    # exactly `max_tokens` per prompt from a random model.
    for kind in ("reference", "vllm"):
        if kind == "reference":
            ref_model = model.to("cuda", torch.bfloat16) if gpu else model
            engine = ReferenceEngine(ref_model, n_prompts, max_len, eos_ids=[], temperature=1.0, seed=0)
        else:
            engine = VLLMEngine(
                folder,
                n_prompts,
                max_len,
                temperature=1.0,
                top_p=1.0,
                seed=0,
                dtype="bfloat16" if gpu else "float32",
                placement=VLLMPlacement(cpu_cores=None, gpu_ids=[0]) if gpu else VLLMPlacement(cores, None),
                kv_cache_gib=1,
                ignore_eos=True,
            )
        run_engine(engine, prompts[:4], 4, 10_000)  # warm-up
        tokens, secs = run_engine(engine, prompts, max_tokens, 0)
        engine.close()
        rows.append(
            {
                "model": name,
                "params_m": round(args.num_params() / 1e6, 1),
                "engine": kind,
                "tokens": tokens,
                "seconds": round(secs, 2),
                "tokens_per_s": round(tokens / secs, 1),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavours", default="debug,small")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "engines.json"))
    ap.add_argument("--gpu", action="store_true", help="both engines on GPU 0 in bf16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            r for f in a.flavours.split(",") for r in bench(f, a.prompts, a.max_tokens, a.threads, Path(tmp), a.gpu)
        ]
    cols = ["model", "params_m", "engine", "tokens", "seconds", "tokens_per_s"]
    report(
        Path(a.out),
        "Generation throughput: reference engine vs vLLM",
        cols,
        [[r[c] for c in cols] for r in rows],
        {"prompts": a.prompts, "max_tokens": a.max_tokens, "threads": a.threads, "rows": rows},
    )


if __name__ == "__main__":
    main()
