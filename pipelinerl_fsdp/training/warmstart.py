"""Supervised warm start: train the initial policy on reference solutions with the FSDP2 trainer, save an HF folder.

RL runs start from that folder; when it already exists it is reused, not retrained. The folder records which
held-out problems its training never drew (`held_out.json`), so that a run reusing it with another held-out set
(a larger `task.eval_size`, another seed) fails instead of evaluating on problems the warm start may have learnt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import (
    Config,
    ConfigError,
    ModelConfig,
    TokenizerConfig,
    TrainerConfig,
    WarmstartConfig,
)
from pipelinerl_fsdp.episodes import check_env_template, env_turn_ids
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.models import Transformer, build_model, flavour_args, load_hf_model, save_hf_folder
from pipelinerl_fsdp.preflight import check_sequence_budget, check_vocab, stop_token_ids
from pipelinerl_fsdp.rl.packing import PackedRow, pack_into_bins, pack_row, per_target
from pipelinerl_fsdp.tasks import Problem, ProblemStream, Task, make_task
from pipelinerl_fsdp.tokenizer import build_char_tokenizer, encode_prompt, load_tokenizer
from pipelinerl_fsdp.training.evaluation import greedy_accuracy
from pipelinerl_fsdp.training.metrics import WARMSTART_CONSOLE, MetricsLogger
from pipelinerl_fsdp.training.parallelize import full_state_dict
from pipelinerl_fsdp.training.policy import Policy, build_policy, shard
from pipelinerl_fsdp.training.train_step import forward_backward, sum_over_ranks

HELD_OUT_FILE = "held_out.json"


def held_out_fingerprints(task: Task) -> list[str]:
    """Short hashes of the task's held-out problems (`Task.problem_id`: the prompt, with an environment's hidden
    state), those its training streams never draw."""
    return sorted({hashlib.sha256(task.problem_id(p).encode()).hexdigest()[:16] for p in task.eval_split()})


def held_out_problem(folder: Path, task: Task) -> str | None:
    """Why the warm-start `folder` cannot be used with this config's held-out split, or None when every held-out
    problem was held out of its training too (or the folder has no record to check against)."""
    record = folder / HELD_OUT_FILE
    if not record.is_file():
        return None
    kept_out = set(json.loads(record.read_text())["prompt_sha256_16"])
    mine = held_out_fingerprints(task)
    missing = [h for h in mine if h not in kept_out]
    if not missing:
        return None
    return (
        f"warmstart.path {folder}: {len(missing)} of this run's {len(mine)} held-out problems (task {task.name}, "
        f"task.eval_size={task.cfg.eval_size}, task.eval_seed={task.cfg.eval_seed}) were not held out when it was "
        "trained, so held-out accuracy would count problems it may have learnt. Delete the folder to train it "
        "again with this held-out set, or point warmstart.path elsewhere"
    )


def is_complete_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    has_weights = (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    return (p / "config.json").is_file() and (p / "tokenizer.json").is_file() and has_weights


def initial_tokenizer(fmt: TokenizerConfig, model: ModelConfig, task: Task) -> PreTrainedTokenizerBase:
    """tokenizer.path, else the model folder's tokenizer, else a character tokenizer of the task's alphabet. The
    warm-start folder stores it, so that every later stage loads this same tokenizer."""
    if fmt.path:
        return load_tokenizer(fmt.path)
    if model.path:
        return load_tokenizer(model.path)
    if not task.alphabet:
        raise ConfigError(
            f"task {task.name!r} has no character alphabet: set tokenizer.path (or model.path) to a "
            "folder with its tokenizer"
        )
    return build_char_tokenizer(task.alphabet)


def initial_model(model: ModelConfig, seed: int, tokenizer: PreTrainedTokenizerBase) -> Transformer:
    """model.path loaded, else model.flavour randomly initialised (seeded with `seed`: identical on every rank)."""
    if model.path:
        loaded = load_hf_model(model.path)
        check_vocab(loaded.args.vocab_size, tokenizer, f"model.path {model.path}")
        return loaded
    args = flavour_args(
        model.flavour,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return build_model(args, seed=seed)


def encode_supervised(
    tokenizer: PreTrainedTokenizerBase, problem: Problem, fmt: TokenizerConfig, task: Task | None = None
) -> tuple[list[int], list[float]]:
    """Prompt + solution as one sequence, and the loss mask over its targets: 1 on the model's turns, each ended by
    EOS; 0 on the prompt and on a multi-turn task's environment turns (`Task.supervised_turns`, appended as the
    episode would: `episodes.env_turn_ids`)."""
    seq = encode_prompt(tokenizer, problem.prompt, fmt)
    mask = [0.0] * (len(seq) - 1)
    turns = task.supervised_turns(problem) if task is not None else [problem.solution]
    for i, text in enumerate(turns):
        if i % 2 == 0:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        else:
            ids = env_turn_ids(tokenizer, text, fmt)
        seq += ids
        mask += [float(i % 2 == 0)] * len(ids)
    return seq, mask


@dataclass
class SupervisedBatch(PackedRow):
    """A packed micro-batch of the warm start: the row, and 1 on the targets the loss counts ([T])."""

    loss_mask: torch.Tensor


def supervised_micro_batches(
    seqs: list[list[int]], masks: list[list[float]], budget: int, device: torch.device
) -> list[SupervisedBatch]:
    """Sequences and their loss masks (`encode_supervised`) packed into micro-batches under `budget` tokens."""
    out = []
    for b in pack_into_bins([len(s) for s in seqs], budget):
        row_seqs = [seqs[i] for i in b]
        mask = per_target(row_seqs, [masks[i] for i in b], "loss_mask", device)
        out.append(SupervisedBatch(**vars(pack_row(row_seqs, device)), loss_mask=mask))
    return out


def _check_generation_budget(task: Task, tokenizer: PreTrainedTokenizerBase, fmt: TokenizerConfig, seed: int) -> None:
    problems = task.eval_split() or [task.train_problem(seed, i) for i in range(100)]
    n_prompt = {id(p): len(encode_prompt(tokenizer, p.prompt, fmt)) for p in problems}
    longest = max(len(encode_supervised(tokenizer, p, fmt, task)[0]) - n_prompt[id(p)] for p in problems)
    if longest > task.cfg.max_new_tokens:
        raise ConfigError(
            f"task.max_new_tokens = {task.cfg.max_new_tokens} is too small: held-out solutions of "
            f"task {task.name!r} need up to {longest} tokens with EOS"
        )


@dataclass
class WarmStartParts:
    """The warm start loop's collaborators, built by `run_warmstart`."""

    task: Task
    tokenizer: PreTrainedTokenizerBase
    policy: Policy
    stream: ProblemStream  # this rank's problems
    evaluate: Callable[[], float]  # the policy's held-out greedy accuracy (collective: the same on every rank)
    logger: MetricsLogger
    world: World


class WarmStart:
    """Supervised steps on reference solutions, evaluated every `warmstart.eval_every` steps; `run` loops."""

    def __init__(
        self, ws: WarmstartConfig, trainer: TrainerConfig, fmt: TokenizerConfig, log_every: int, parts: WarmStartParts
    ) -> None:
        self.ws, self.trainer, self.fmt, self.log_every = ws, trainer, fmt, log_every
        self.task, self.tokenizer, self.policy, self.stream = parts.task, parts.tokenizer, parts.policy, parts.stream
        self.evaluate, self.logger, self.world = parts.evaluate, parts.logger, parts.world

    def run(self) -> float:
        """`warmstart.steps` steps (fewer once `warmstart.stop_at_accuracy` is reached); returns the last held-out
        accuracy."""
        ws, trainer, world = self.ws, self.trainer, self.world
        group, device = world.trainer_group, world.device
        n_ranks = len(world.trainer_ranks)
        model = self.policy.model
        per_rank = ws.batch_size // n_ranks
        total_tokens = 0
        t_last = time.time()
        accuracy = float("nan")
        for step in range(ws.steps):
            encoded = [
                encode_supervised(self.tokenizer, next(self.stream), self.fmt, self.task) for _ in range(per_rank)
            ]
            seqs, masks = [e[0] for e in encoded], [e[1] for e in encoded]
            n_loss_tokens = sum_over_ranks([sum(sum(m) for m in masks)], group, device)[0]

            def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: SupervisedBatch, n_loss_tokens=n_loss_tokens):
                nll = -(logp * mb.loss_mask).sum()
                # FSDP averages gradients over ranks: scale so the step minimises the mean over all ranks' tokens.
                return nll * n_ranks / n_loss_tokens, float(nll.detach())

            budget, defer = trainer.decided()
            micro = supervised_micro_batches(seqs, masks, budget, device)
            nlls = forward_backward(model, micro, loss_fn, 1.0, group, device, trainer.logprob_chunk_size, defer)
            lr = self.policy.lr
            grad_norm = self.policy.step()
            total_tokens += sum(len(s) - 1 for s in seqs)
            last = step == ws.steps - 1
            evaluated = (step + 1) % ws.eval_every == 0 or last
            if evaluated:
                accuracy = self.evaluate()  # the same on every rank (counts summed): every rank stops at one step
            stop = evaluated and bool(ws.stop_at_accuracy) and accuracy >= ws.stop_at_accuracy
            if (step + 1) % self.log_every == 0 or last or stop:
                nll = sum_over_ranks([sum(nlls, 0.0)], group, device)[0]
                toks = sum_over_ranks([float(total_tokens)], group, device)[0]
                now = time.time()
                values = {
                    "loss": nll / n_loss_tokens,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "train_tokens_per_s": toks / (now - t_last),
                    "samples": (step + 1) * ws.batch_size,
                }
                if evaluated:
                    values["eval_accuracy"] = accuracy
                self.logger.log(step + 1, values)
                total_tokens, t_last = 0, now
            if stop:
                if world.is_main:
                    print(
                        f"[warmstart] held-out accuracy {accuracy:.3f} >= warmstart.stop_at_accuracy = "
                        f"{ws.stop_at_accuracy} after {step + 1} steps: stopping",
                        flush=True,
                    )
                break
        if ws.steps == 0:
            accuracy = self.evaluate()
        return accuracy


def run_warmstart(cfg: Config, world: World) -> Path:
    """Train (or reuse) the warm-start folder; returns its path. Collective over all trainer ranks."""
    out = Path(cfg.warmstart.path)
    task = make_task(cfg.task)
    group, device = world.trainer_group, world.device
    n_ranks, dp_rank = len(world.trainer_ranks), world.trainer_rank
    if is_complete_hf_folder(out):
        why = held_out_problem(out, task)
        if why:
            raise ConfigError(why)
        if world.is_main:
            print(f"[warmstart] reusing {out} (delete it to train again)", flush=True)
            if not (out / HELD_OUT_FILE).is_file():
                print(
                    f"[warmstart] note: {out} has no {HELD_OUT_FILE} (made by an older version): cannot check that "
                    "this run's held-out problems were kept out of its training; delete it to train it again",
                    flush=True,
                )
        return out

    tokenizer = initial_tokenizer(cfg.tokenizer, cfg.model, task)
    if task.multi_turn:
        check_env_template(tokenizer, cfg.tokenizer)
    _check_generation_budget(task, tokenizer, cfg.tokenizer, cfg.job.seed)
    check_sequence_budget(cfg.trainer, cfg.inference, cfg.tokenizer, cfg.task, task, tokenizer)
    model = initial_model(cfg.model, cfg.job.seed, tokenizer)
    args = model.args
    stops = stop_token_ids(cfg.model.path, tokenizer) if cfg.model.path else [tokenizer.eos_token_id]
    eval_model = build_model(args, device=device, dtype=torch.float32)
    ws = cfg.warmstart
    policy = build_policy(shard(model, world, cfg.trainer), ws.optimizer, ws.steps)
    stream = ProblemStream(task, seed=cfg.job.seed, offset=dp_rank, stride=n_ranks)
    logger = MetricsLogger(
        Path(cfg.job.output_dir) / "warmstart",
        cfg.metrics.tensorboard,
        world.is_main,
        prefix="warmstart/",
        total_steps=ws.steps,
        console_fields=WARMSTART_CONSOLE,
    )
    if world.is_main:
        print(
            f"[warmstart] {args.model_type} {args.num_params() / 1e6:.2f}M params, task {task.name}, "
            f"{ws.steps} steps x {ws.batch_size} sequences, {n_ranks} trainer rank(s) on {device}",
            flush=True,
        )

    def evaluate() -> float:
        eval_model.load_state_dict(full_state_dict(policy.model))
        return greedy_accuracy(
            eval_model,
            task,
            tokenizer,
            cfg.task.max_new_tokens,
            cfg.tokenizer,
            dp_rank,
            n_ranks,
            group,
            stops,
        )

    parts = WarmStartParts(task, tokenizer, policy, stream, evaluate, logger, world)
    accuracy = WarmStart(ws, cfg.trainer, cfg.tokenizer, cfg.metrics.log_every, parts).run()
    if ws.min_accuracy and accuracy < ws.min_accuracy:
        raise RuntimeError(
            f"warm start reached held-out accuracy {accuracy:.3f} < warmstart.min_accuracy = "
            f"{ws.min_accuracy}; raise warmstart.steps or the learning rate"
        )
    full = full_state_dict(policy.model, keep=world.is_main, on_cpu=True)
    if world.is_main:
        save_warmstart_folder(out, args, full, tokenizer, held_out_fingerprints(task))
        print(f"[warmstart] saved {out} (held-out greedy accuracy {accuracy:.3f})", flush=True)
    logger.close()
    dist.barrier(group=group)
    return out


def save_warmstart_folder(
    out: Path,
    args,
    state_dict: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    held_out: list[str],
) -> None:
    """Write model + tokenizer + the held-out record (`held_out_fingerprints`) to a temporary folder, then rename:
    a crash never leaves a half folder to reuse."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    args = dataclasses.replace(args, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_hf_folder(tmp, args, state_dict, dtype=torch.float32)
    tokenizer.save_pretrained(str(tmp))
    (tmp / HELD_OUT_FILE).write_text(json.dumps({"prompt_sha256_16": held_out}))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
