"""Our trainer step against a plain PyTorch loop on the same batches, and where the difference goes.

    python -m benchmarks.step_vs_plain [--flavour debug] [--samples 64] [--prompt 8] [--completion 5] \
        [--steps 30] [--threads 1] [--out benchmarks/results/step_vs_plain.json]

The default is the default CPU job's trainer: the ~0.8M-parameter debug model, 64 samples of ~13 tokens per step,
one thread. Both sides get the same random samples (prompt and completion token ids, behaviour log-probs,
advantages) and start from the same weights.

- plain: the model unwrapped, the batch right-padded to [samples, longest], logits -> log_softmax -> gather,
  REINFORCE loss with truncated importance weights, backward, `torch.optim.AdamW` (no FSDP, no packing, no
  chunked log-probs, no clipping);
- ours, timed part by part: packing into micro-batches (`rl_micro_batches`), forward/backward through FSDP2 with
  chunked log-probs and the job's loss (`forward_backward`, `policy_loss`), gradient clipping + AdamW + schedule
  (`clip_and_step`), and the per-step weight push's gather into send buffers (`WeightSender.push`, on a world of
  one rank, so the broadcast itself costs nothing here: `benchmarks/weight_sync.py` measures that).

The real model's shape: `--model outputs/models/SmolLM2-135M-Instruct` (its config.json; random weights, the same
arithmetic) with samples of its word-problem task's size, e.g. `--samples 16 --prompt 60 --completion 40
--steps 5`. Against the hardware: this machine's matrix-product rate, measured here with the same thread count
on the step's own shapes (tokens x hidden times hidden x {hidden, intermediate, vocabulary}), and the fraction of
it the step reaches: 6 x parameters x tokens (the tied head counted: its product is real work) over the step's
time. `--profile`: the top operators of one step by self CPU time (torch.profiler).

Prints a table (median ms per step of each part, and our total over the plain loop); writes JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.config import OptimizerConfig
from pipelinerl_fsdp.models import build_model, flavour_args, read_model_args
from pipelinerl_fsdp.rl.batching import RLMicroBatch, rl_micro_batches
from pipelinerl_fsdp.rl.loss import policy_loss
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.training.optim import build_optimizer
from pipelinerl_fsdp.training.parallelize import apply_fsdp
from pipelinerl_fsdp.training.train_step import clip_and_step, forward_backward
from pipelinerl_fsdp.transport.weights import WeightSender

IS_CLIP = 5.0
PARTS = ("plain", "pack", "forward_backward", "optimizer", "push")


def make_samples(n: int, prompt: int, completion: int, vocab: int, seed: int) -> list[Sample]:
    """Random samples with lengths around the given means (completion 1..2x-1), as an engine would send them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = rng.randint(1, 2 * completion - 1)
        out.append(
            Sample(
                group_id=i // 4,
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                completion_ids=[rng.randrange(vocab) for _ in range(c)],
                logprobs=[-rng.uniform(0.1, 3.0) for _ in range(c)],
                versions=[0] * c,
                reward=float(rng.random() < 0.5),
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, samples: list[Sample]) -> None:
    """The textbook loop: pad, forward, log-softmax, REINFORCE with truncated importance weights, AdamW."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest - 1)
    behaviour = torch.zeros(len(seqs), longest - 1)
    adv = torch.tensor([s.advantage for s in samples])[:, None]
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        first = len(s.prompt_ids) - 1  # the position that predicts the first completion token
        mask[i, first : first + len(s.completion_ids)] = 1
        behaviour[i, first : first + len(s.completion_ids)] = torch.tensor(s.logprobs)
    pos = torch.arange(longest)[None].expand(len(seqs), -1)
    logits = model(ids, pos)[:, :-1]
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    weight = torch.exp(logp.detach() - behaviour).clamp(max=IS_CLIP)
    loss = -(weight * adv * logp * mask).sum() / len(samples)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def matmul_gflops(tokens: int, shapes: list[tuple[int, int]], repeats: int = 5) -> float:
    """This machine's fp32 matrix-product rate (GFLOP/s, at the current thread count) on [tokens, k] x [k, n] for
    each (k, n) in `shapes`, forward and both backward products: the median over `repeats` rounds of all of them."""
    flops = sum(3 * 2 * tokens * k * n for k, n in shapes)
    mats = [(torch.randn(tokens, k), torch.randn(k, n), torch.randn(tokens, n)) for k, n in shapes]
    rates = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for x, w, g in mats:
            x @ w  # forward
            g @ w.T  # gradient of the input
            x.T @ g  # gradient of the weight
        if r:
            rates.append(flops / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def profile_step(model: torch.nn.Module, micro: list, loss_fn, device: torch.device, rows: int = 15) -> str:
    """The top operators of one forward/backward by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(model, micro, loss_fn, 1.0, None, device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavour", default="debug")
    p.add_argument("--model", type=Path, default=None, help="an HF model folder: its shape instead of --flavour")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--completion", type=int, default=5)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "step_vs_plain.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cpu")
    args = read_model_args(a.model) if a.model else flavour_args(a.flavour)
    name = a.model.name if a.model else a.flavour
    plain = build_model(args, device=device, seed=0)
    ours = build_model(args, device=device, seed=0)
    apply_fsdp(ours, init_device_mesh("cpu", (1,)), torch.float32, torch.float32)
    opt_cfg = OptimizerConfig(lr=1e-6, lr_schedule="constant", warmup_steps=0, grad_clip=1.0)
    our_opt, our_sched = build_optimizer(ours.parameters(), opt_cfg, a.steps + 2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-6, weight_decay=0.0)
    sender = WeightSender(ours, None, 0, True, torch.float32, device)
    settings = ReinforceTISConfig(is_clip=IS_CLIP)

    def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: RLMicroBatch):
        x = mb.loss_input
        return policy_loss(logp[0], replace(x, weight=x.mask / a.samples), settings)

    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    for step in range(a.steps + 1):
        samples = make_samples(a.samples, a.prompt, a.completion, args.vocab_size, seed=step)
        t = [time.perf_counter()]
        plain_step(plain, plain_opt, samples)
        t.append(time.perf_counter())
        micro = rl_micro_batches(samples, a.micro_batch_tokens, device)
        t.append(time.perf_counter())
        forward_backward(ours, micro, loss_fn, 1.0, None, device)
        t.append(time.perf_counter())
        clip_and_step(ours, our_opt, our_sched, opt_cfg.grad_clip)
        t.append(time.perf_counter())
        sender.push(step + 1)
        t.append(time.perf_counter())
        if step > 0:  # the first step warms up (allocator, FSDP's lazy init)
            for k, t0, t1 in zip(PARTS, t, t[1:]):
                parts[k].append(t1 - t0)
    ms = {k: median_ms(v) for k, v in parts.items()}
    if a.profile:
        print(profile_step(ours, rl_micro_batches(samples, a.micro_batch_tokens, device), loss_fn, device))
    total = sum(v for k, v in ms.items() if k != "plain")
    tokens = sum(
        len(s.prompt_ids) + len(s.completion_ids)
        for s in make_samples(a.samples, a.prompt, a.completion, args.vocab_size, 0)
    )
    hidden, inter = args.hidden_size, args.intermediate_size
    gflops = matmul_gflops(
        min(tokens, a.micro_batch_tokens), [(hidden, hidden), (hidden, inter), (hidden, args.vocab_size)]
    )
    model_gflop = 6 * args.num_params() * tokens / 1e9  # per step, forward + backward (attention left out)
    print(
        f"{args.num_params() / 1e6:.2f}M-parameter '{name}' model, {a.samples} samples (~{tokens} tokens) per "
        f"step, {a.threads} thread(s), median of {a.steps} steps; matrix products here: {gflops:.1f} GFLOP/s"
    )
    table = [[k, round(ms[k], 1), f"{ms[k] / total:.0%}"] for k in ("pack", "forward_backward", "optimizer", "push")]
    table += [["**ours, total**", round(total, 1), "100%"], ["plain loop", round(ms["plain"], 1), ""]]
    row = {
        "model": name,
        "params_m": round(args.num_params() / 1e6, 1),
        "samples": a.samples,
        "tokens": tokens,
        "threads": a.threads,
        "median_ms": ms,
        "ratio": total / ms["plain"],
        "tokens_per_s": tokens / (total / 1000),
        "plain_tokens_per_s": tokens / (ms["plain"] / 1000),
        "matmul_gflops": gflops,
        # the share of the measured matrix-product rate that the model's own arithmetic takes of our step
        "matmul_frac": model_gflop / (total / 1000) / gflops,
        "plain_matmul_frac": model_gflop / (ms["plain"] / 1000) / gflops,
    }
    report(a.out, "Our trainer step against a textbook padded loop", ["part", "ms per step", "share of our step"],
           table, row)  # fmt: skip
    print(
        f"ours / plain: {total / ms['plain']:.2f}x; ours {row['tokens_per_s']:.1f} tokens/s = "
        f"{row['matmul_frac']:.0%} of the matrix-product rate (plain loop {row['plain_matmul_frac']:.0%})"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
