"""What evaluation on the engines costs: a held-out set evaluated through the job's machinery (the job's vLLM
engine in its own processes, `EngineEvaluator` requests, the task's reward pool) against a plain `vllm.LLM.generate`
of the same requests (same prompts, sampling settings, per-request seeds, cores), which scores nothing.

    python scripts/convert_smollm2.py   # once: the default config's model
    python -m benchmarks.eval_cost [--config math_smollm2_cpu] [--problems 32] [--samples 2] [--repeats 2] \
        [--out benchmarks/results/eval_cost.json]

Start-up (engine processes, model load, warm-up) is not timed. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import RESULTS, ROOT, report

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipelinerl_fsdp.config import Config
    from pipelinerl_fsdp.inference.evaluator import EngineEvaluator
    from pipelinerl_fsdp.tasks import Task


def one_engine_evaluator(cfg: Config, task: Task, tokenizer: PreTrainedTokenizerBase) -> EngineEvaluator:
    """The job's evaluator as one engine of one runs it: every held-out problem of the task."""
    from pipelinerl_fsdp.inference.evaluator import EngineEvaluator

    return EngineEvaluator(
        cfg.eval,
        cfg.tokenizer,
        task,
        tokenizer,
        0,
        1,
        final_version=cfg.rl.max_steps,
        max_new_tokens=cfg.task.max_new_tokens,
    )


def job_side(cfg, task, tokenizer, stops, max_len: int, cores: str, repeats: int) -> tuple[list[float], int, float]:
    """Seconds per evaluation of every set through the job's engine, completion tokens per evaluation, pass@1."""
    from pipelinerl_fsdp.inference.evaluator import evaluate_alone
    from pipelinerl_fsdp.inference.factory import generation_engine

    inf = cfg.inference
    evaluator = one_engine_evaluator(cfg, task, tokenizer)
    engine = generation_engine(cfg.inference, cfg.job, cfg.world, cfg.model.path, max_len, stops, cores=cores)
    scorer = task.scorer()
    try:
        evaluate_alone(evaluator, engine, scorer, tokenizer, stops, -1, inf.max_num_seqs)  # warm-up
        secs, tokens, acc = [], 0, 0.0
        for rep in range(repeats):
            tokens0 = engine.stats()[0]
            t0 = time.perf_counter()
            reports = evaluate_alone(evaluator, engine, scorer, tokenizer, stops, rep, inf.max_num_seqs)
            secs.append(time.perf_counter() - t0)
            tokens = engine.stats()[0] - tokens0
            acc = sum(sum(r.correct) for r in reports) / sum(len(r.problems) * r.samples for r in reports)
        return secs, tokens, acc
    finally:
        scorer.close()
        engine.close()


def plain_side(cfg, prompts: list[list[int]], stops, max_len: int, repeats: int) -> tuple[list[float], int]:
    """Seconds per `LLM.generate` of the same requests (the first call is the warm-up), completion tokens. Built by
    hand on purpose: vLLM's own offline API, the baseline the job's engine is measured against."""
    from vllm import LLM, SamplingParams

    from pipelinerl_fsdp.inference.evaluator import EVAL_RID_BASE
    from pipelinerl_fsdp.inference.vllm_options import prefill_token_budget

    inf, ev = cfg.inference, cfg.eval
    llm = LLM(
        model=cfg.model.path,
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=inf.max_num_seqs,
        seed=cfg.job.seed,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=prefill_token_budget(inf.max_num_seqs, max_len, on_gpu=False),
        disable_log_stats=True,
    )

    def params(rid: int) -> SamplingParams:
        # the job engine's per-request seed (vllm_options.sampling_params), so both sides sample the same tokens
        return SamplingParams(
            temperature=ev.temperature,
            top_p=ev.top_p,
            max_tokens=cfg.task.max_new_tokens,
            stop_token_ids=stops,
            seed=cfg.job.seed * 1_000_003 + rid,
        )

    reqs = [{"prompt_token_ids": p} for p in prompts]
    secs, tokens = [], 0
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        outs = llm.generate(reqs, [params(EVAL_RID_BASE + i) for i in range(len(reqs))], use_tqdm=False)
        if rep:
            secs.append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    return secs, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="math_smollm2_cpu")
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7, help="evaluation sampling temperature (0: greedy)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}")
    p.add_argument("--out", type=Path, default=RESULTS / "eval_cost.json")
    a = p.parse_args()
    os.chdir(ROOT)
    from pipelinerl_fsdp.configure import load_config
    from pipelinerl_fsdp.preflight import sequence_limits, stop_token_ids
    from pipelinerl_fsdp.tasks import make_task
    from pipelinerl_fsdp.tokenizer import load_tokenizer

    cfg = load_config(
        [
            "--config",
            a.config,
            f"--task.eval_size={a.problems}",
            f"--eval.samples={a.samples}",
            f"--eval.temperature={a.temperature}",
        ]
    )
    if not cfg.model.path or not Path(cfg.model.path).is_dir():
        raise SystemExit(f"model folder {cfg.model.path!r} not found: run python scripts/convert_smollm2.py first")
    task = make_task(cfg.task)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    stops = stop_token_ids(cfg.model.path, tokenizer)
    _, max_len = sequence_limits(cfg.tokenizer, cfg.task, task, tokenizer)
    # the evaluator's requests in its order: every set's problems x samples
    probe = one_engine_evaluator(cfg, task, tokenizer)
    probe.start(0)
    prompts = [list(r.prompt_ids) for r in probe.queue]

    job_secs, job_tokens, acc = job_side(cfg, task, tokenizer, stops, max_len, a.cores, a.repeats)
    plain_secs, plain_tokens = plain_side(cfg, prompts, stops, max_len, a.repeats)
    job_s, plain_s = statistics.median(job_secs), statistics.median(plain_secs)
    rows = [
        ("job engine + evaluator + reward pool", job_s, job_tokens),
        ("plain vllm.LLM.generate", plain_s, plain_tokens),
    ]
    print(
        f"\n{a.config}: {len(prompts)} requests ({a.problems} problems x {a.samples} samples, temperature "
        f"{a.temperature}), max_num_seqs {cfg.inference.max_num_seqs}, cores {a.cores}, median of {a.repeats}\n"
    )
    ratio = job_s / plain_s
    per_token = (job_s / max(job_tokens, 1)) / (plain_s / max(plain_tokens, 1))
    report(
        a.out,
        f"Evaluation cost: the job's engine path against plain vllm.LLM.generate ({a.config})",
        ["path", "seconds", "completion tokens", "tokens/s"],
        [[name, round(s, 2), t, round(t / s)] for name, s, t in rows],
        {
            "config": a.config,
            "requests": len(prompts),
            "problems": a.problems,
            "samples": a.samples,
            "temperature": a.temperature,
            "cores": a.cores,
            "job": {"seconds": job_secs, "tokens": job_tokens, "pass@1": acc},
            "plain": {"seconds": plain_secs, "tokens": plain_tokens},
            "job_over_plain_time": ratio,
            "job_over_plain_per_token": per_token,
        },
    )
    print(f"job / plain: {ratio:.3f}x in time, {per_token:.3f}x per completion token; pass@1 {acc:.3f}")


if __name__ == "__main__":
    main()
