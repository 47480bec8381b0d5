"""The RL trainer step's speed as an RL run trains, on one device: tokens/s, exact FLOPs and MFU.

A step is the job's own (`training.rl_step.RLStep`): samples with an RL length mix (short prompts, completions
from a long-tailed distribution up to --max-completion tokens) packed into micro-batches of
--micro-batch-tokens, several per optimizer step, the loss mask on completions, the job's RL loss
(`rl_loss_fn`: REINFORCE with truncated importance weights, the statistics read once per step), clipping and
AdamW; the model built from a named shape with random weights and sharded as the trainer shards it
(`training.policy.shard`: FSDP2 on one rank, the configured precision, activation checkpointing, compile).

    python -m benchmarks.rl_step_speed --flavour qwen2.5-0.5b                    # GPU: 4 x 32k tokens per step
    python -m benchmarks.rl_step_speed --flavour qwen2.5-1.5b --checkpointing
    python -m benchmarks.rl_step_speed --flavour smollm2-135m --quick            # CPU (fp32)
    python -m benchmarks.rl_step_speed --flavour qwen2.5-0.5b --lora-rank 16     # LoRA: the adapters train

--lora-rank R builds the model as the trainer does under `[lora]` (`training.policy.adapt`: adapters with alpha 32 on
all seven linears of every layer, as train_configs/lora.toml; everything else frozen and stored in
`frozen_base_dtype`, bf16 on a GPU; the adapters fp32), shards it, gives the adapters PEFT's initial values (B zero:
the step's FLOPs are the same whatever the values) and optimises the adapters only (`build_policy`).

FLOPs per step, exact for the packed rows (model FLOPs: the recomputation of activation checkpointing and of the
chunked log-probs' backward is not counted): the blocks' matrix products 6 x (block matmul parameters) x tokens;
causal attention 12 x heads x head_dim x (L(L+1)/2 per document of L positions) per layer (forward QK^T and PV,
twice that backward); the output head 6 x hidden x vocab at the positions it runs (the completion tokens only).
`6N` (N every parameter, embeddings once) x tokens is printed beside it.
Under LoRA the base is frozen, the head and embeddings included (only the seven linears of the blocks are targeted):
its matrix products need the forward (2x) and the input gradient (2x) but no weight gradient, so the blocks count
4 x (block matmul parameters) x tokens and the head 4 x hidden x vocab per head position; attention is unchanged;
each adapted linear of in -> out adds 2 r (in + out) per token forward (x A^T, then B^T) and 4 r (in + out) backward
(the gradient of A's output and of B, of A and of the input). In the first layer the input of q, k and v (the normed
embeddings) needs no gradient (nothing before it trains) and autograd computes none: minus 2 x hidden x (q + k + v
widths) per token from the blocks and 2 r x hidden x 3 from the adapters. MFU = FLOPs / step time / the device's
dense bf16 peak (H100 and H200 SXM: 989 TFLOP/s, H100 PCIe 756, the NVL cards 835; --peak-tflops for others); on CPU
the fraction of this machine's measured fp32 matrix-product rate at the model's shapes (`step_vs_plain.matmul_gflops`).
`pack_s`: the host's time to pack the step's samples and move them to the device (`rl_micro_batches`, the step's
first act, while the GPU waits), inside `step_s`; `pack_frac` its share.
`plan_gib`: what `--job.stage=plan` predicts for this step on one rank (weight sync and CUDA context left out),
next to the measured `peak_mem_gib`. Steps are timed with CUDA events on GPU (time.perf_counter on CPU), after
--warmup steps. Prints a table; writes JSON, also after each timed step (`"partial": true`, the steps so far), so a
run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import RESULTS, report
from benchmarks.step_vs_plain import matmul_gflops
from pipelinerl_fsdp.config import LoRAConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.models.hf_io import read_model_args
from pipelinerl_fsdp.plan import trainer_memory
from pipelinerl_fsdp.rl.batching import rl_micro_batches
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.training.parallelize import resolve_compile, resolve_param_dtype

VERSION = 5  # the trained version; tokens are sampled by it or by the one before (lag 0 and 1)
# SmolLM2-135M-Instruct's shape (the CPU runs' real model; its config.json needs the converted folder)
SHAPES = {
    "smollm2-135m": ModelArgs(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        qkv_bias=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        max_position_embeddings=8192,
    )
}
# dense bf16 peaks by a name's part, the first that matches (NVIDIA's datasheets): the PCIe and NVL cards run
# slower clocks and power than the SXM ones, whose names carry neither ("NVIDIA H100 80GB HBM3")
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0), ("H200", 989.0))


def model_shape(name: str, folder: Path | None) -> ModelArgs:
    """The shape of an HF folder's config.json, else a named shape (SHAPES, then the project's flavours)."""
    if folder is not None:
        return read_model_args(folder)
    return SHAPES[name] if name in SHAPES else flavour_args(name)


def rl_samples(rng: random.Random, tokens: int, budget: int, max_completion: int, vocab: int) -> list[Sample]:
    """Samples of about `tokens` tokens in all, as an RL step gets them: prompts of 32-512 tokens (at most a
    quarter of `budget`), completions log-normal (median 600 tokens, sigma 1.2: a long tail) cut to
    [16, max_completion], each sequence within `budget`; groups of 8; completion tokens sampled by the version
    before VERSION up to a random point, then by VERSION (an in-flight update); each sample's loss weight
    1 / samples (`loss.normalize = "sequences"`)."""
    out: list[Sample] = []
    total = 0
    while total < tokens:
        prompt = rng.randint(32, min(512, budget // 4))
        completion = int(min(max_completion, budget - prompt, max(16, rng.lognormvariate(math.log(600), 1.2))))
        cut = rng.randint(0, completion - 1)  # tokens before it sampled by the version before
        out.append(
            Sample(
                group_id=len(out) // 8,
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                completion_ids=[rng.randrange(vocab) for _ in range(completion)],
                logprobs=[-rng.uniform(0.05, 3.0) for _ in range(completion)],
                versions=[VERSION - 1] * cut + [VERSION] * (completion - cut),
                reward=float(rng.random() < 0.5),
                advantage=rng.uniform(-1, 1),
            )
        )
        total += prompt + completion
    for s in out:
        s.loss_weight = 1 / len(out)
    return out


def step_flops(args: ModelArgs, doc_positions: list[int], head_tokens: int, lora_rank: int = 0) -> dict[str, float]:
    """Model FLOPs of one forward + backward (see the module docstring) over packed documents of the given
    positions (a document of n tokens has n - 1), the head at `head_tokens` positions; with `lora_rank` > 0 the base
    frozen and adapters of that rank on all seven linears of every layer (an `adapters` item)."""
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    h, heads, kv, layers = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.num_hidden_layers
    inter = args.intermediate_size
    block_matmul = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    tokens = sum(doc_positions)
    pairs = sum(n * (n + 1) // 2 for n in doc_positions)  # (query, key) pairs causal attention computes
    attention = 12.0 * layers * heads * hd * pairs
    if lora_rank == 0:
        return {"blocks": 6.0 * layers * block_matmul * tokens, "attention": attention,
                "head": 6.0 * h * args.vocab_size * head_tokens}  # fmt: skip
    qkv = (heads + 2 * kv) * hd  # the output widths of q, k, v; their input is h
    widths = 7 * h + 2 * heads * hd + 2 * kv * hd + 3 * inter  # in + out summed over the seven linears
    r = lora_rank
    return {
        "blocks": 4.0 * layers * block_matmul * tokens - 2.0 * h * qkv * tokens,
        "attention": attention,
        "head": 4.0 * h * args.vocab_size * head_tokens,
        "adapters": 6.0 * r * widths * layers * tokens - 2.0 * r * h * 3 * tokens,
    }


def documents(position_ids: torch.Tensor) -> list[int]:
    """The positions of each packed document of a row (a document starts where its position is 0)."""
    starts = (position_ids[0] == 0).nonzero()[:, 0].tolist() + [position_ids.shape[1]]
    return [b - a for a, b in zip(starts, starts[1:])]


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The device's dense bf16 peak: --peak-tflops, else by the GPU's name (None when unknown)."""
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavour", default="qwen2.5-0.5b", help=f"a shape: {sorted(SHAPES)} or a model flavour")
    p.add_argument("--model", type=Path, default=None, help="an HF model folder: its shape instead of --flavour")
    # sizes: (full, --quick); a value given wins over both
    p.add_argument("--micro-batch-tokens", type=int, help="32768 (--quick: 512)")
    p.add_argument("--micro-batches", type=int, help="per optimizer step, about (packing decides): 4 (--quick: 2)")
    p.add_argument("--max-completion", type=int, help="8192 (--quick: 384)")
    p.add_argument("--warmup", type=int, help="3 (--quick: 1)")
    p.add_argument("--steps", type=int, help="10 timed steps (--quick: 2)")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--defer-grad-sync", choices=["true", "false"], default="true")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (alpha 32, all seven "
                   "linears) train, the base frozen (0: full fine-tuning)")  # fmt: skip
    p.add_argument("--param-dtype", default="auto", help="trainer.param_dtype (auto: bf16 on GPU, fp32 on CPU; "
                   "the CPU rehearsal of the GPU's bf16 frozen base: bfloat16)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="CPU size: about 2 x 512 tokens, 1 + 2 steps")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (job.threads_per_rank; 0: every core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed steps, one more step under torch.profiler: its operators by self device time (CPU: "
        "self CPU time), the top 40, written to this file (where the step's time goes)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "rl_step_speed.json")
    a = p.parse_args()
    sizes = {"micro_batch_tokens": (32768, 512), "micro_batches": (4, 2), "max_completion": (8192, 384)}
    sizes.update(warmup=(3, 1), steps=(10, 2))
    for key, (full, quick) in sizes.items():
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else full)
    args = model_shape(a.flavour, a.model)
    cfg = load_config(
        [
            "--job.stage=warmstart",
            "--world.inference_ranks=0",
            f"--trainer.micro_batch_tokens={a.micro_batch_tokens}",
            f"--trainer.defer_grad_sync={a.defer_grad_sync}",
            f"--trainer.activation_checkpointing={'full' if a.checkpointing else 'off'}",
            f"--trainer.compile={a.compile}",
            f"--trainer.param_dtype={a.param_dtype}",
            "--trainer.optimizer.warmup_steps=0",
            f"--job.threads_per_rank={a.threads}",
        ]
    )
    from pipelinerl_fsdp.job.world import init_world
    from pipelinerl_fsdp.models.lora import init_adapters
    from pipelinerl_fsdp.training.policy import adapt, build_policy, shard
    from pipelinerl_fsdp.training.rl_step import RLStep

    world = init_world(cfg)
    device = world.device
    cuda = device.type == "cuda"
    lora = LoRAConfig(enabled=True, rank=a.lora_rank, alpha=32.0) if a.lora_rank > 0 else None
    model = build_model(args, seed=a.seed)
    if lora is not None:  # as `policy.load_sharded` builds it: adapters, the base frozen in its compute dtype
        adapt(model, lora, resolve_param_dtype(cfg.trainer.param_dtype, device))
    model = shard(model, world, cfg.trainer)
    if lora is not None:
        init_adapters(model, a.seed)
    policy = build_policy(model, cfg.trainer.optimizer, a.warmup + a.steps + 1)
    step = RLStep(policy, None, cfg.loss, 0.0, cfg.trainer, 1.0, world.trainer_group, device, 1)
    rng = random.Random(a.seed)
    # one batch for every step: the same work each time (a fresh batch per step would time the packing twice)
    samples = rl_samples(rng, int(0.97 * a.micro_batches * a.micro_batch_tokens), a.micro_batch_tokens,
                         a.max_completion, args.vocab_size)  # fmt: skip
    micro = rl_micro_batches(samples, a.micro_batch_tokens, torch.device("cpu"), VERSION)
    docs = [n for mb in micro for n in documents(mb.position_ids)]
    head_tokens = int(sum(float(mb.loss_input.mask.sum()) for mb in micro))
    flops = step_flops(args, docs, head_tokens, a.lora_rank)
    pack_s = statistics.median(packing_seconds(samples, a.micro_batch_tokens, device) for _ in range(3))
    peak = peak_tflops(device, a.peak_tflops)
    tokens, total = sum(docs), sum(flops.values())
    dtype = str(resolve_param_dtype(cfg.trainer.param_dtype, device)).removeprefix("torch.")
    plan_items = trainer_memory(replace(cfg.trainer, param_dtype=dtype), args, 1, a.checkpointing, lora=lora)
    plan = sum(x for k, x in plan_items.items() if not k.startswith(("weight sync", "CUDA context")))

    def summary(times: list[float]) -> dict:
        secs = statistics.median(times)
        return {
            "shape": a.model.name if a.model else a.flavour,
            "params_m": round(args.num_params() / 1e6, 1),
            "lora_rank": a.lora_rank,
            "trained_params_m": round(sum(p.numel() for p in policy.model.parameters() if p.requires_grad) / 1e6, 2),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "dtype": dtype,
            "compile": resolve_compile(a.compile, device),
            "checkpointing": a.checkpointing,
            "defer_grad_sync": cfg.trainer.defer_grad_sync,
            "micro_batches": len(micro),
            "tokens": tokens,
            "documents": len(docs),
            "head_tokens": head_tokens,
            "timed_steps": len(times),
            "step_s": round(secs, 4),
            "step_s_min": round(min(times), 4),
            "pack_s": round(pack_s, 4),
            "pack_frac": round(pack_s / secs, 4),
            "tokens_per_s": round(tokens / secs, 1),
            "tflop_step": round(total / 1e12, 3),
            "tflop_blocks_attention_head": [round(flops[k] / 1e12, 3) for k in ("blocks", "attention", "head")],
            "tflop_adapters": round(flops.get("adapters", 0.0) / 1e12, 4),
            "tflop_6n": round(6 * args.num_params() * tokens / 1e12, 3),
            "achieved_tflop_s": round(total / secs / 1e12, 3),
            "mfu": round(total / secs / (peak * 1e12), 4) if peak else None,
            "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            "plan_gib": round(plan / 2**30, 2),
        }

    times: list[float] = []
    for i in range(a.warmup + a.steps):
        if i == a.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step.run([samples], 1, VERSION)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            step.run([samples], 1, VERSION)
            seconds = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(seconds)
            # the steps so far, rewritten after each: a run killed by a time limit keeps its numbers
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({**summary(times), "partial": True}, indent=1))
    if a.profile is not None:
        profile_step(lambda: step.run([samples], 1, VERSION), cuda, a.profile)
    h, inter, v = args.hidden_size, args.intermediate_size, args.vocab_size
    qkv = (args.num_attention_heads + 2 * args.num_key_value_heads) * (args.head_dim or h // args.num_attention_heads)
    cpu_rate = None if cuda else matmul_gflops(min(tokens, 2048), [(h, qkv), (h, inter), (inter, h), (h, v)]) * 1e9
    row = summary(times)
    rate = total / statistics.median(times)
    row["cpu_matmul_gflop_s"] = round(cpu_rate / 1e9, 1) if cpu_rate else None
    row["frac_of_matmul_rate"] = round(rate / cpu_rate, 4) if cpu_rate else None
    report(a.out, "RL trainer step speed on one device", list(row), [list(row.values())], row)
    dist.destroy_process_group()


def packing_seconds(samples: list[Sample], budget: int, device: torch.device) -> float:
    """Host seconds to pack the step's samples into micro-batches on `device` (`rl_micro_batches`, which the step
    runs first: time the GPU waits, since the step before ended with a read of its gradient norm)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    rl_micro_batches(samples, budget, device, VERSION)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def profile_step(run_step: Callable[[], object], cuda: bool, path: Path) -> None:
    """One step under torch.profiler; its operators' table by self device time (self CPU time without CUDA), the
    top 40, into `path` (not a timed step: the profiler adds its own cost)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        run_step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
    print(f"profile: {path}", flush=True)


if __name__ == "__main__":
    main()
