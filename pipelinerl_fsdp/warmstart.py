"""Supervised warm start: train the initial policy on reference solutions with the FSDP2 trainer, save an HF folder.

RL runs start from that folder; when it already exists it is reused, not retrained.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import Config, ConfigError
from pipelinerl_fsdp.evaluation import greedy_accuracy
from pipelinerl_fsdp.metrics import MetricsLogger
from pipelinerl_fsdp.models import Transformer, build_model, flavour_args, load_hf_model, save_hf_folder
from pipelinerl_fsdp.optim import build_optimizer
from pipelinerl_fsdp.parallelize import DTYPES, apply_fsdp, full_state_dict, resolve_param_dtype
from pipelinerl_fsdp.rl.packing import collate_packed, pack_into_bins
from pipelinerl_fsdp.tasks import Problem, Task, make_task
from pipelinerl_fsdp.tasks.arithmetic import ProblemStream
from pipelinerl_fsdp.tokenizer import build_char_tokenizer, encode_prompt, load_tokenizer
from pipelinerl_fsdp.train_step import clip_and_step, forward_backward, sum_over_ranks
from pipelinerl_fsdp.world import World


def task_from_config(cfg: Config) -> Task:
    t = cfg.task
    kw: dict = {"eval_size": t.eval_size, "eval_seed": t.eval_seed, "digits": t.digits}
    if t.name == "chain_sum":
        kw.update(min_terms=t.min_terms, max_terms=t.max_terms)
    return make_task(t.name, **kw)


def is_complete_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    has_weights = (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    return (p / "config.json").is_file() and (p / "tokenizer.json").is_file() and has_weights


def initial_tokenizer(cfg: Config, task: Task) -> PreTrainedTokenizerBase:
    """tokenizer.path, else the model folder's tokenizer, else a character tokenizer of the task's alphabet."""
    if cfg.tokenizer.path:
        return load_tokenizer(cfg.tokenizer.path)
    if cfg.model.path:
        return load_tokenizer(cfg.model.path)
    return build_char_tokenizer(task.alphabet)


def initial_model(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Transformer:
    """model.path loaded, else model.flavour randomly initialised (seeded: identical on every rank)."""
    if cfg.model.path:
        model = load_hf_model(cfg.model.path)
        if model.args.vocab_size < len(tokenizer):
            raise ConfigError(f"model.path {cfg.model.path}: vocab_size {model.args.vocab_size} is smaller than "
                              f"the tokenizer's {len(tokenizer)} tokens")
        return model
    args = flavour_args(cfg.model.flavour, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return build_model(args, seed=cfg.job.seed)


def encode_supervised(tokenizer: PreTrainedTokenizerBase, problem: Problem, use_chat_template: bool
                      ) -> tuple[list[int], list[float]]:
    """Prompt + solution + EOS as one sequence, and the loss mask over its targets (1 on solution tokens)."""
    prompt = encode_prompt(tokenizer, problem.prompt, use_chat_template)
    solution = tokenizer(problem.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    seq = prompt + solution
    mask = [0.0] * (len(prompt) - 1) + [1.0] * len(solution)
    return seq, mask


def _check_generation_budget(cfg: Config, task: Task, tokenizer: PreTrainedTokenizerBase) -> None:
    longest = max(len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in task.eval_split())
    if longest > cfg.task.max_new_tokens:
        raise ConfigError(f"task.max_new_tokens = {cfg.task.max_new_tokens} is too small: held-out solutions of "
                          f"task {task.name!r} need up to {longest} tokens with EOS ({cfg.source})")


def run_warmstart(cfg: Config, world: World) -> Path:
    """Train (or reuse) the warm-start folder; returns its path. Collective over all trainer ranks."""
    out = Path(cfg.warmstart.path)
    task = task_from_config(cfg)
    group, device = world.trainer_group, world.device
    n_ranks, dp_rank = len(world.trainer_ranks), world.trainer_rank
    if is_complete_hf_folder(out):
        if world.is_main:
            print(f"[warmstart] reusing {out} (delete it to train again)", flush=True)
        return out

    tokenizer = initial_tokenizer(cfg, task)
    _check_generation_budget(cfg, task, tokenizer)
    model = initial_model(cfg, tokenizer).to(device)
    args = model.args
    eval_model = build_model(args, device=device, dtype=torch.float32)
    param_dtype = resolve_param_dtype(cfg.trainer.param_dtype, device)
    apply_fsdp(model, world.trainer_mesh, param_dtype, DTYPES[cfg.trainer.reduce_dtype])
    ws, tr = cfg.warmstart, cfg.trainer
    optimizer, scheduler = build_optimizer(model.parameters(), ws.lr, tr.betas, tr.eps, tr.weight_decay,
                                           ws.warmup_steps, ws.steps, ws.lr_schedule, ws.min_lr_ratio)
    stream = ProblemStream(task, seed=cfg.job.seed, offset=dp_rank, stride=n_ranks)
    per_rank = ws.batch_size // n_ranks
    logger = MetricsLogger(Path(cfg.job.output_dir) / "warmstart", cfg.metrics.tensorboard, world.is_main,
                           prefix="warmstart/")
    if world.is_main:
        print(f"[warmstart] {args.model_type} {args.num_params() / 1e6:.2f}M params, task {task.name}, "
              f"{ws.steps} steps x {ws.batch_size} sequences, {n_ranks} trainer rank(s) on {device}", flush=True)

    def evaluate() -> float:
        eval_model.load_state_dict(full_state_dict(model))
        return greedy_accuracy(eval_model, task, tokenizer, cfg.task.max_new_tokens,
                               cfg.tokenizer.use_chat_template, dp_rank, n_ranks, group)

    total_tokens = 0
    t_last = time.time()
    accuracy = float("nan")
    for step in range(ws.steps):
        encoded = [encode_supervised(tokenizer, next(stream), cfg.tokenizer.use_chat_template)
                   for _ in range(per_rank)]
        seqs, masks = [e[0] for e in encoded], [e[1] for e in encoded]
        n_loss_tokens = sum_over_ranks([sum(sum(m) for m in masks)], group, device)[0]

        def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: dict[str, torch.Tensor]):
            nll = -(logp * mb["loss_mask"]).sum()
            # FSDP averages gradients over ranks: scale so the step minimises the mean over all ranks' tokens.
            return nll * n_ranks / n_loss_tokens, {"nll": float(nll.detach())}

        bins = pack_into_bins([len(s) for s in seqs], tr.micro_batch_tokens)
        micro = [collate_packed([seqs[i] for i in b], {"loss_mask": [masks[i] for i in b]}, device) for b in bins]
        stats = forward_backward(model, micro, loss_fn, 1.0, group, device, tr.logprob_chunk_size)
        lr = scheduler.get_last_lr()[0]
        grad_norm = clip_and_step(model, optimizer, scheduler, tr.grad_clip)
        total_tokens += sum(len(s) - 1 for s in seqs)
        last = step == ws.steps - 1
        if (step + 1) % ws.eval_every == 0 or last:
            accuracy = evaluate()
        if (step + 1) % cfg.metrics.log_every == 0 or last:
            nll = sum_over_ranks([stats.get("nll", 0.0)], group, device)[0]
            toks = sum_over_ranks([float(total_tokens)], group, device)[0]
            now = time.time()
            values = {"loss": nll / n_loss_tokens, "lr": lr, "grad_norm": grad_norm,
                      "train_tokens_per_s": toks / (now - t_last), "samples": (step + 1) * ws.batch_size}
            if (step + 1) % ws.eval_every == 0 or last:
                values["eval_accuracy"] = accuracy
            logger.log(step + 1, values)
            total_tokens, t_last = 0, now
    if ws.steps == 0:
        accuracy = evaluate()
    if ws.min_accuracy and accuracy < ws.min_accuracy:
        raise RuntimeError(f"warm start reached held-out accuracy {accuracy:.3f} < warmstart.min_accuracy = "
                           f"{ws.min_accuracy}; raise warmstart.steps or the learning rate")
    full = full_state_dict(model)
    if world.is_main:
        save_warmstart_folder(out, args, full, tokenizer)
        print(f"[warmstart] saved {out} (held-out greedy accuracy {accuracy:.3f})", flush=True)
    logger.close()
    dist.barrier(group=group)
    return out


def save_warmstart_folder(out: Path, args, state_dict: dict[str, torch.Tensor],
                          tokenizer: PreTrainedTokenizerBase) -> None:
    """Write model + tokenizer to a temporary folder, then rename: a crash never leaves a half folder to reuse."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    args = dataclasses.replace(args, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_hf_folder(tmp, args, state_dict, dtype=torch.float32)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
