"""Where a CPU vLLM engine's time goes, against a plain batched generate loop of the same requests on the same core.

Run (no torchrun; vLLM from the `cpu` extra; the long-tail task's warm start, which
`python -m benchmarks.learning_speed --task chain_sum` makes once):
    python -m benchmarks.engine_overhead --out benchmarks/results/engine_overhead.json

Every engine gets the same requests: `--requests` prompts of the long-tail task (2-12 two-digit terms) per round,
all submitted at once and run until the last one stops (EOS or `--max-tokens`), as a conventional-mode generation
batch does; `--rounds` measured rounds after a warm-up. Everything is pinned to one core (`--core`), as an inference
rank of the default job is. Engines:
- `plain`: the project's pure-PyTorch engine (`ReferenceEngine`: one process, batched decode with a KV cache).
- `vllm`: the job's vLLM engine as the job runs it (no detokenisation).
- `vllm+text`: the same with vLLM's detokenisation on (the job's setting before this benchmark).
- `vllm-offline`: vLLM alone, as its users run it: `LLM.generate` on the same token ids and sampling (log-probs of
  the sampled tokens, no detokenisation), in this process, bound to the same core;
- `hf`: transformers' batched `generate` (left-padded, sampling, KV cache), the plain baseline everyone has.
For vLLM, the CPU seconds of each of its processes over the measured rounds: the client (this process: vLLM's
output processing, detokenisation, our loop), the engine core (scheduling, serialisation, the hop to the worker)
and the worker (the model). Prints a table and writes JSON.

A real model and task: `--config word_problems_smollm2_cpu` takes the model, the task's prompts through the
chat template, the stop tokens and `task.max_new_tokens` from that training config, e.g.
    python -m benchmarks.engine_overhead --config word_problems_smollm2_cpu --requests 16 --rounds 2 \
        --engines vllm,vllm-offline,hf --out benchmarks/results/engine_overhead_smollm2.json
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

from benchmarks.engines import run_engine
from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference.factory import generation_engine
from pipelinerl_fsdp.inference.placement import VLLMPlacement
from pipelinerl_fsdp.preflight import stop_token_ids
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import ChainSum, ChainSumConfig
from pipelinerl_fsdp.tokenizer import encode_prompt, load_tokenizer


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


class OneCall:
    """`run_engine`'s add/step interface over an API that generates a whole batch in one call (`step`)."""

    def __init__(self) -> None:
        self.pending: list = []

    def add(self, request) -> None:
        self.pending.append(request)

    def num_unfinished(self) -> int:
        return len(self.pending)

    def close(self) -> None:
        pass


class OfflineVLLM(OneCall):
    """vLLM's own offline API (`LLM.generate`), one generate call per round: built by hand on purpose, the baseline
    of vLLM alone that the job's engine is measured against."""

    def __init__(self, model: Path, max_num_seqs: int, max_len: int, core: int, stops: list[int]) -> None:
        from vllm import LLM

        import pipelinerl_fsdp.inference.vllm_engine as ve

        ve.quiet_vllm_logs()
        os.environ.update(ve.engine_env(VLLMPlacement(str(core), None), os.environ))
        kv = ve.kv_cache_gib_needed(ve.read_model_args(model), max_num_seqs, max_len, 4)
        self.llm = LLM(
            model=str(model), dtype="float32", max_model_len=max_len, max_num_seqs=max_num_seqs, seed=0,
            enforce_eager=True, kv_cache_memory_bytes=int(kv * 2**30), logprobs_mode="processed_logprobs",
            enable_prefix_caching=False, disable_log_stats=True,
        )  # fmt: skip
        super().__init__()
        self.stops = stops

    def step(self) -> None:
        from vllm import SamplingParams, TokensPrompt

        reqs, self.pending = self.pending, []
        params = [
            SamplingParams(temperature=1.0, max_tokens=r.max_tokens, logprobs=0, stop_token_ids=self.stops,
                           seed=r.request_id, detokenize=False)
            for r in reqs
        ]  # fmt: skip
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs], params, use_tqdm=False)
        for r, o in zip(reqs, outs):
            r.tokens = list(o.outputs[0].token_ids)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class HFGenerate(OneCall):
    """transformers' batched `generate`: the plain baseline (left padding, sampling, its KV cache)."""

    def __init__(self, model: Path, stops: list[int]) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.stops = stops

    @torch.no_grad()
    def step(self) -> None:
        reqs, self.pending = self.pending, []
        width = max(len(r.prompt_ids) for r in reqs)
        pad = self.stops[0]
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in reqs])
        attn = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs])
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=self.stops, pad_token_id=pad,
        )  # fmt: skip
        for r, row in zip(reqs, out[:, width:].tolist()):
            end = next((i + 1 for i, t in enumerate(row) if t in self.stops), len(row))  # the stop token counts
            r.tokens = row[: min(end, r.max_tokens)]


def bench(kind: str, model: Path, prompts: list[list[int]], a: argparse.Namespace, stops: list[int]) -> dict:
    import pipelinerl_fsdp.inference.vllm_engine as ve

    max_len = max(map(len, prompts)) + a.max_tokens
    original = ve.sampling_params
    if kind == "vllm-offline":
        engine = OfflineVLLM(model, a.requests, max_len, a.core, stops)
    elif kind == "hf":
        engine = HFGenerate(model, stops)
    else:
        if kind == "vllm+text":  # the engine's sampling parameters as they were, detokenisation on
            ve.sampling_params = functools.partial(original, detokenize=True)
        # the job's engine as an inference rank builds it: every request in flight at once, sampling at temperature
        # 1, seed 0, fp32, vLLM's KV cache what the requests need and its threads on the one core
        engine_args = ["--inference.engine=reference"] if kind == "plain" else ["--inference.engine=vllm"]
        engine_args += [] if kind == "plain" else ["--inference.kv_cache_gib=0"]
        engine_args += [f"--inference.max_num_seqs={a.requests}", "--inference.temperature=1.0"]
        engine_args += ["--inference.top_p=1.0", "--inference.dtype=float32", "--job.seed=0"]
        cfg = load_config([*(["--config", a.config] if a.config else []), *engine_args])
        engine = generation_engine(cfg.inference, cfg.job, cfg.world, str(model), max_len, stops, cores=str(a.core))
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
    ap.add_argument("--max-tokens", type=int, default=0, help="0: 128, or the --config's task.max_new_tokens")
    ap.add_argument("--config", default="", help="a training config: its model, task prompts, template and stops")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    ap.add_argument("--engines", default="plain,vllm,vllm+text")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_overhead.json")
    a = ap.parse_args()
    n_prompts = a.requests * (a.rounds + 1)
    if a.config:
        cfg = load_config(["--config", a.config])
        a.model = Path(cfg.model.path)
        a.max_tokens = a.max_tokens or cfg.task.max_new_tokens
        task = make_task(cfg.task)
        tok = load_tokenizer(cfg.tokenizer.path or a.model)
        prompts = [encode_prompt(tok, task.train_problem(0, i).prompt, cfg.tokenizer) for i in range(n_prompts)]
        stops = stop_token_ids(a.model, tok)
    else:
        if not (a.model / "config.json").is_file():
            raise SystemExit(
                f"--model {a.model}: no HF model folder there; `python -m benchmarks.learning_speed --task "
                "chain_sum` makes the long-tail warm start once (or pass another folder)"
            )
        a.max_tokens = a.max_tokens or 128
        chain = ChainSum(ChainSumConfig(digits=2, min_terms=2, max_terms=12, max_new_tokens=a.max_tokens))
        tok = load_tokenizer(a.model)
        rng = random.Random(0)
        prompts = [tok(chain.sample(rng).prompt, add_special_tokens=False)["input_ids"] for _ in range(n_prompts)]
        stops = [tok.eos_token_id]
    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    rows = [bench(kind, a.model, prompts, a, stops) for kind in a.engines.split(",")]
    plain = next((r["tokens_per_s"] for r in rows if r["engine"] == "plain"), None)
    print(
        f"{a.rounds} rounds of {a.requests} {a.config or 'long-tail'} requests (<= {a.max_tokens} tokens) on core "
        f"{a.core}; tokens/s: median (min-max) over rounds; CPU ms per 1k tokens by process"
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
        "Engine overhead: tokens/s of vLLM through our engine against vLLM alone, HF generate and our plain engine "
        "(CPU ms per 1k tokens by process)",
        ["engine", "tokens/s", "vs plain", "client", "engine core", "worker"],
        table,
        {"settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows},
    )


if __name__ == "__main__":
    main()
