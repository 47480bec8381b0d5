"""Held-out accuracy of a model on a task before any training: the start point a task is chosen by.

    python -m scripts.task_accuracy --config word_problems_smollm2_cpu [--size 300] [-- --task.levels=[1]]

(from the repository root, as a module: it writes its table and JSON under `benchmarks/results/` with
`benchmarks.harness`)

The job's own pieces, with no torchrun: the config (`--config` and `--section.key=value` overrides after `--`),
its task's held-out split (the first `--size` problems), its tokenizer and chat template, its stop tokens, and the
job's vLLM engine on one core (`--core`), greedy (temperature 0) unless `--temperature` says otherwise. Each
completion is scored by the task's reward; the table gives accuracy, the outcome mix (correct, wrong, truncated at
`task.max_new_tokens`), completion lengths and the engine's tokens/s; the JSON keeps ten example completions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.factory import generation_engine
from pipelinerl_fsdp.models.peft_io import loadable_policy
from pipelinerl_fsdp.preflight import stop_token_ids
from pipelinerl_fsdp.rewards.outcomes import outcome_for
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tokenizer import completion_text, encode_prompt, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a train_configs/ name or TOML path")
    ap.add_argument("--size", type=int, default=300, help="held-out problems evaluated (from the split's start)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=32, help="requests in flight (vLLM max_num_seqs)")
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="--section.key=value, after --")
    a = ap.parse_args()
    # the job's vLLM engine (fp32, the KV cache --batch sequences need) with --batch requests in flight; each
    # request carries its own temperature
    engine_args = ["--inference.engine=vllm", f"--inference.max_num_seqs={a.batch}", "--inference.temperature=1.0"]
    engine_args += ["--inference.top_p=1.0", "--inference.dtype=float32", "--inference.kv_cache_gib=0"]
    cfg = load_config(["--config", a.config, *a.overrides, *engine_args])
    task = make_task(cfg.task)
    problems = task.eval_split()[: a.size]
    if len(problems) < a.size:
        raise SystemExit(f"--size {a.size}: the task's held-out split has {len(problems)} problems (task.eval_size)")
    model = str(loadable_policy(cfg.model.path))  # a LoRA run's export: its merged HF folder
    tok = load_tokenizer(cfg.tokenizer.path or model)
    stops = stop_token_ids(model, tok)
    prompts = [encode_prompt(tok, p.prompt, cfg.tokenizer) for p in problems]
    budget = cfg.task.max_new_tokens
    max_len = max(map(len, prompts)) + budget

    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    engine = generation_engine(cfg.inference, cfg.job, cfg.world, model, max_len, stops, cores=str(a.core))
    try:
        reqs = [Request(i, p, budget, temperature=a.temperature) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add(r)
        while engine.num_unfinished():
            engine.step()
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    texts = [completion_text(tok, r.tokens, stops) for r in reqs]
    rewards = [task.reward(t, p.answer) for t, p in zip(texts, problems)]
    outcomes = [outcome_for(rw, r.finished) for rw, r in zip(rewards, reqs)]
    lengths = [len(r.tokens) for r in reqs]
    n = len(reqs)
    frac = {k: round(outcomes.count(k) / n, 3) for k in ("correct", "wrong", "truncated")}
    row = {
        "config": a.config,
        "overrides": " ".join(a.overrides),
        "problems": n,
        "accuracy": round(sum(rewards) / n, 3),
        **frac,
        "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        "completion_tokens_mean": round(statistics.mean(lengths), 1),
        "completion_tokens_max": max(lengths),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
    }
    examples = [
        {"prompt": p.prompt, "answer": p.answer, "completion": t, "reward": rw}
        for p, t, rw in list(zip(problems, texts, rewards))[:10]
    ]
    name = f"task_accuracy_{Path(a.config).stem}"
    report(
        a.out or RESULTS / f"{name}.json",
        f"Start accuracy: {model}, {n} held-out problems, temperature {a.temperature}",
        list(row),
        [list(row.values())],
        {"row": row, "examples": examples},
    )


if __name__ == "__main__":
    main()
