"""Generation throughput and in-flight weight-load time: vLLM (in-process VLLMEngine) vs the reference engine.

Run (no torchrun; vLLM from the `cpu` extra on this machine):
    python benchmarks/engines.py --flavours debug,base --prompts 64 --max-tokens 64 \
        --out benchmarks/results/engines.json

Both engines get the same random model (saved as an HF folder with the character tokenizer), the same prompts and
sampling (temperature 1, EOS ignored, so both generate prompts x max_tokens tokens). `load_ms` is the time to load
a full new set of weights between two steps (vLLM: `reload_weights`; reference: copy into the parameters), next to
a plain memcpy of the same bytes. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pipelinerl_fsdp.inference.engine import ReferenceEngine, Request  # noqa: E402
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder  # noqa: E402
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET  # noqa: E402
from pipelinerl_fsdp.tokenizer import build_char_tokenizer  # noqa: E402

# "base": the ~100M-class body (hidden 768, 12 layers) with the character vocabulary.
SHAPES = {"debug": {}, "base": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                    num_attention_heads=12, num_key_value_heads=4, head_dim=None)}


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    reqs = [Request(i, p, max_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add(r)
    while engine.num_unfinished():
        engine.step()
    return sum(len(r.tokens) for r in reqs), time.perf_counter() - t0


def bench(name: str, n_prompts: int, max_tokens: int, work: Path) -> list[dict]:
    from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine

    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, **SHAPES[name])
    model = build_model(args, seed=0).eval()
    other = build_model(args, seed=1).state_dict()
    folder = work / name
    save_hf_folder(folder, args, model.state_dict())
    tok.save_pretrained(str(folder))
    nbytes = sum(t.numel() * t.element_size() for t in other.values())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (8,), generator=gen).tolist() for _ in range(n_prompts)]
    max_len = 8 + max_tokens + 8
    engines = {
        "reference": ReferenceEngine(model, n_prompts, max_len, eos_ids=[], temperature=1.0, seed=0),
        "vllm": VLLMEngine(folder, n_prompts, max_len, temperature=1.0, seed=0, ignore_eos=True),
    }
    buf_a, buf_b = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    buf_b.copy_(buf_a)  # first touch of fresh pages is not a copy's cost
    t0 = time.perf_counter()
    buf_b.copy_(buf_a)
    memcpy_ms = 1000 * (time.perf_counter() - t0)
    rows = []
    for kind, engine in engines.items():
        run_engine(engine, prompts[:4], 4)  # warm-up
        tokens, secs = run_engine(engine, prompts, max_tokens)
        t0 = time.perf_counter()
        engine.load_weights(list(other.items()))
        load_ms = 1000 * (time.perf_counter() - t0)
        rows.append({"model": name, "params_m": round(args.num_params() / 1e6, 1), "engine": kind,
                     "tokens": tokens, "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1),
                     "load_ms": round(load_ms, 1), "memcpy_ms": round(memcpy_ms, 1), "mbytes": round(nbytes / 1e6, 1)})
    del engines
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavours", default="debug,base")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="benchmarks/results/engines.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for f in a.flavours.split(",") for r in bench(f, a.prompts, a.max_tokens, Path(tmp))]
    cols = ["model", "params_m", "engine", "tokens", "seconds", "tokens_per_s", "mbytes", "load_ms", "memcpy_ms"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": a.prompts, "max_tokens": a.max_tokens, "threads": a.threads,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
