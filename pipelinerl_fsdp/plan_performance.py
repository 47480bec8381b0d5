"""The plan's performance part (`--job.stage=plan`, after the memory plan): the job simulator (`pipelinerl_fsdp.perf`)
on the cluster `[plan]` describes, for this job's own layout and mode, then every mode at its best split and setting,
and a recommendation with how sure it is.

Costs come from the GPU's datasheet (`plan.gpu`, `plan.inter_node_gbs`) and the model's shape, with the trainer's
MFU an assumption (`plan.mfu`), or from a measured profile (`plan.profile`: `benchmarks.perf_profile`'s JSON, for the
job's own layout only: a profile is one machine's). Completion lengths: `plan.lengths`, else the task's own
distribution where it has one (countdown), else the math-reasoning distribution of `perf/data/`. "How sure": the
recommended mode and the runner-up are simulated again at their chosen settings and splits under the assumptions
moved (MFU 0.25 and 0.5, the engine's per-step overhead halved and doubled).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipelinerl_fsdp.config import InferenceConfig, ModelConfig, PlanConfig, RLConfig, TaskConfig, TrainerConfig
from pipelinerl_fsdp.perf.lengths import Empirical, Lengths
from pipelinerl_fsdp.perf.planner import (
    Assumptions,
    Choice,
    Workload,
    compare,
    quantile_lengths,
    recommend,
    run,
    spec_costs,
)
from pipelinerl_fsdp.perf.profile import load_profile
from pipelinerl_fsdp.perf.simulate import SimCosts, SimResult
from pipelinerl_fsdp.perf.spec import ModelShape, gpu_spec
from pipelinerl_fsdp.plan_sizes import plan_model_args

MATH_LENGTHS = Path(__file__).parent / "perf" / "data" / "math_reasoning_lengths.json"
# the trainer steps each simulation runs (the first tenth is its warm-up): enough for a steady state, few enough
# for the plan of a 128-GPU job to take seconds
SIM_STEPS = 10
# the settings each mode is searched over in a plan (a reduced grid: seconds, not minutes)
PLAN_KS = {"pipeline": (1,), "async": (1, 2), "conventional": (1, 4, 16), "colocated": (1, 4, 16)}


def job_lengths(task: TaskConfig, plan: PlanConfig) -> tuple[Lengths, str]:
    """The completion lengths the plan simulates, and where they come from."""
    budget = task.max_new_tokens
    if plan.lengths:
        path = Path(plan.lengths)
        if path.is_dir():
            return Empirical.from_rollouts(path), f"the rollout dumps in {path}"
        return quantile_lengths(path, budget), f"{path}, cut at {budget}"
    if task.name == "countdown":  # L lines of 9 tokens each (EOS included), L drawn as the task draws it
        import numpy as np

        from pipelinerl_fsdp.tasks.countdown import tail_weights

        lo, hi = task.line_range()  # type: ignore[attr-defined]
        n = np.arange(lo, hi + 1)
        w = np.array(tail_weights(lo, hi, task.tail_exponent)) if task.lengths == "tail" else np.ones(len(n))  # type: ignore[attr-defined]
        cdf = np.cumsum(w) / w.sum()
        lines = n[np.searchsorted(cdf, (np.arange(4000) + 0.5) / 4000)]  # the inverse CDF at 4,000 points
        return Empirical(
            tuple(int(9 * x) for x in lines)
        ), f"the countdown task's own ({task.lengths}, 9 tokens a line)"  # type: ignore[attr-defined]
    return quantile_lengths(MATH_LENGTHS, budget), f"{MATH_LENGTHS.name} (math reasoning), cut at {budget}"


def job_workload(
    model: ModelConfig, rl: RLConfig, inference: InferenceConfig, task: TaskConfig, trainer: TrainerConfig,
    plan: PlanConfig,
) -> tuple[Workload, str]:  # fmt: skip
    args, _ = plan_model_args(model)
    lengths, source = job_lengths(task, plan)
    prompt = getattr(task, "max_prompt_tokens", 0) or 64
    w = Workload(
        shape=ModelShape.from_args(args),
        lengths=lengths,
        batch_size=rl.batch_size,
        attempts=rl.attempts,
        slots=inference.max_num_seqs,
        prompt_tokens=min(prompt, 512),
        max_new_tokens=task.max_new_tokens,
        max_lag=rl.max_lag,
        steps=SIM_STEPS,
        micro_batch_tokens=trainer.micro_batch_tokens if isinstance(trainer.micro_batch_tokens, int) else 32768,
    )
    return w, source


def fmt_row(label: str, c: Choice) -> str:
    r: SimResult = c.result
    return (
        f"| {label} | {c.name} | {c.engine_gpus} / {c.trainer_gpus} | {r.samples_per_s:.1f} | "
        f"{1 / r.steps_per_s:.1f} | {r.lag_p50:.0f} / {r.lag_p90:.0f} / {r.lag_max} | {r.engine_occupancy:.2f} | "
        f"{r.trainer_busy_frac:.2f} | {r.engine_paused_frac:.3f} |"
    )


def performance_plan(
    plan: PlanConfig, model: ModelConfig, rl: RLConfig, inference: InferenceConfig, task: TaskConfig,
    trainer: TrainerConfig, engine_ranks: int,
) -> str:  # fmt: skip
    """The performance part of the plan, as text."""
    gpu = gpu_spec(plan.gpu)
    if plan.inter_node_gbs:
        gpu = dataclasses.replace(gpu, inter_node_bytes_per_s=plan.inter_node_gbs * 1e9)
    gpu = dataclasses.replace(gpu, memory_gib=plan.gpu_memory_gib, gpus_per_node=plan.gpus_per_node)
    tp = inference.tensor_parallel_size
    total = plan.nodes * plan.gpus_per_node
    engine_gpus = engine_ranks * tp
    trainer_gpus = total - engine_gpus
    w, source = job_workload(model, rl, inference, task, trainer, plan)
    a = Assumptions(mfu=plan.mfu, tp=tp)
    if plan.profile:
        p = load_profile(plan.profile)
        if p.decode is None or p.train is None:
            raise ValueError(f"plan.profile {plan.profile}: needs both a decode and a train section")
        costs, basis = SimCosts(p.decode, p.train, p.push), f"measured profile {plan.profile} ({p.hardware})"
    else:
        costs = spec_costs(w, gpu, max(engine_gpus, tp), max(trainer_gpus, 1), a)
        basis = (
            f"spec {gpu.name} (bf16 {gpu.bf16_flops / 1e12:.0f} TFLOP/s, HBM {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, "
            f"{gpu.inter_node_bytes_per_s / 1e9:.0f} GB/s a GPU between nodes), trainer MFU {a.mfu} assumed"
        )
    lines = [
        "",
        f"performance (the job simulator, pipelinerl_fsdp/perf/; {basis}; completion lengths: {source}, mean "
        f"{w.lengths.mean():.0f} tokens; {SIM_STEPS} simulated steps each):",
        "",
        "| layout | mode | engine / trainer GPUs | samples/s | step s | token lag p50 / p90 / max | engine occupancy | "
        "trainer busy | pause share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if rl.mode != "colocated" and trainer_gpus >= 1 and engine_ranks >= 1:
        own = run(w, rl.mode, rl.sync_every, engine_ranks, trainer_gpus, costs)
        lines.append(fmt_row("this job's", Choice(rl.mode, rl.sync_every, engine_gpus, trainer_gpus, own)))
    if plan.profile:
        lines.append("")
        lines.append("(a measured profile is one machine's: the search over layouts needs the spec, plan.profile = '')")
        return "\n".join(lines)
    central = compare(w, gpu, total, a, PLAN_KS)
    for m, c in central.items():
        lines.append(fmt_row("best split" if m != "colocated" else "all GPUs, in turn", c))
    # the two fastest modes again under moved assumptions (the others trail further: they decide nothing)
    top2 = dict(sorted(central.items(), key=lambda mc: -mc[1].result.samples_per_s)[:2])
    variants = [top2]
    for moved in (
        dataclasses.replace(a, mfu=0.25),
        dataclasses.replace(a, mfu=0.5),
        dataclasses.replace(a, decode_overhead_s=a.decode_overhead_s / 2),
        dataclasses.replace(a, decode_overhead_s=a.decode_overhead_s * 2),
    ):
        variants.append({m: again(w, gpu, c, moved) for m, c in top2.items()})
    best, margin, sure = recommend(variants)
    lines += [
        "",
        f"recommendation: {best} ({central[best].name}, {central[best].engine_gpus} engine GPUs / "
        f"{central[best].trainer_gpus} trainer GPUs): {margin:.2f}x the samples/s of the runner-up; {sure} (under MFU "
        "0.25 / 0.5 and the engine's per-step overhead halved / doubled). Samples/s is time to a target at equal "
        "samples: what staleness does to the samples a target takes is not modelled (docs/performance_model.md).",
    ]
    return "\n".join(lines)


def again(w: Workload, gpu, c: Choice, a: Assumptions) -> Choice:
    """`c`'s mode, setting and split simulated again under the assumptions `a`."""
    colocated = c.mode == "colocated"
    costs = spec_costs(w, gpu, c.engine_gpus, c.trainer_gpus, a, colocated=colocated)
    r = run(w, c.mode, c.k, c.engine_gpus // a.tp, c.trainer_gpus, costs)
    return Choice(c.mode, c.k, c.engine_gpus, c.trainer_gpus, r)
