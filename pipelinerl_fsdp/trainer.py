"""The trainer-rank loop of the RL stage: receive rollouts, pack, IS-weighted policy-gradient step, push weights.

The first trainer rank is the collector: its receiver thread takes finished groups from every inference rank;
each step it takes `rl.batch_size` fresh samples (dropping and counting those more than `rl.max_lag` versions
old), splits them across the trainer ranks by token count, and every trainer rank trains on its share in
lockstep. After the optimizer step all trainer ranks gather the weights and the collector broadcasts them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipelinerl_fsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from pipelinerl_fsdp.config import Config, ConfigError, checkpoint_folder
from pipelinerl_fsdp.faults import maybe_fail
from pipelinerl_fsdp.evaluation import greedy_accuracy
from pipelinerl_fsdp.metrics import MetricsLogger
from pipelinerl_fsdp.inference.placement import engine_dtype
from pipelinerl_fsdp.models import load_hf_model, save_hf_folder
from pipelinerl_fsdp.optim import build_optimizer
from pipelinerl_fsdp.parallelize import DTYPES, apply_fsdp, full_state_dict, resolve_param_dtype
from pipelinerl_fsdp.rl.advantages import is_zero_advantage_group
from pipelinerl_fsdp.rl.ess import ess_from_sums
from pipelinerl_fsdp.rl.loss import LossSettings, policy_loss
from pipelinerl_fsdp.rl.packing import collate_packed, pack_into_bins
from pipelinerl_fsdp.tokenizer import load_tokenizer
from pipelinerl_fsdp.train_step import add_reference_logprobs, clip_and_step, forward_backward, sum_over_ranks
from pipelinerl_fsdp.transport.rollouts import RolloutReceiver, Sample
from pipelinerl_fsdp.transport.store_group import join_store_group, store_address
from pipelinerl_fsdp.transport.weights import WeightSender
from pipelinerl_fsdp.warmstart import task_from_config
from pipelinerl_fsdp.world import World


def split_balanced(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Split samples over n ranks: equal counts (±1), greedily balancing tokens (longest first)."""
    order = sorted(range(len(samples)), key=lambda i: -(len(samples[i].prompt_ids) + len(samples[i].completion_ids)))
    parts: list[list[Sample]] = [[] for _ in range(n)]
    tokens = [0] * n
    cap = -(-len(samples) // n)
    for i in order:
        r = min((r for r in range(n) if len(parts[r]) < cap), key=lambda r: tokens[r])
        parts[r].append(samples[i])
        tokens[r] += len(samples[i].prompt_ids) + len(samples[i].completion_ids)
    return parts


def rl_micro_batches(samples: list[Sample], budget: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Pack samples (prompt + completion) into micro-batches; per-token fields aligned with the targets."""
    seqs, fields = [], {"mask": [], "behaviour_logp": [], "advantage": []}
    for s in samples:
        seqs.append(s.prompt_ids + s.completion_ids)
        n_prompt_targets = len(s.prompt_ids) - 1
        n = len(s.completion_ids)
        fields["mask"].append([0.0] * n_prompt_targets + [1.0] * n)
        fields["behaviour_logp"].append([0.0] * n_prompt_targets + list(s.logprobs))
        fields["advantage"].append([0.0] * n_prompt_targets + [s.advantage] * n)
    bins = pack_into_bins([len(s) for s in seqs], budget)
    return [collate_packed([seqs[i] for i in b], {k: [v[i] for i in b] for k, v in fields.items()}, device)
            for b in bins]


@dataclass
class Batch:
    samples: list[Sample]
    dropped_stale: int
    wait_s: float


class Collector:
    """On the first trainer rank: assembles each step's batch from the rollout receiver."""

    def __init__(self, receiver: RolloutReceiver, cfg: Config) -> None:
        self.receiver, self.cfg = receiver, cfg
        self.buffer: list[Sample] = []
        self.engine_stats: dict[int, dict[str, float]] = {}
        self.dropped_total = 0
        self.filtered_total = 0
        self.n_engines = cfg.world.inference_ranks
        self.max_gid: dict[int, int] = {}  # inference index -> newest group id received from it

    def stream_next(self) -> dict[str, int]:
        """Per inference index, the prompt-stream position after the newest group received (for resume)."""
        n = self.n_engines
        return {str(k): v + n for k, v in self.max_gid.items()}

    def next_batch(self, version: int, timeout_s: float) -> Batch:
        rl = self.cfg.rl
        t0 = time.perf_counter()

        def fresh(s: Sample) -> bool:
            return version - min(s.versions, default=version) <= rl.max_lag

        kept = [s for s in self.buffer if fresh(s)]  # leftovers of earlier steps may have aged past max_lag
        dropped = len(self.buffer) - len(kept)
        self.buffer = kept
        while len(self.buffer) < rl.batch_size:
            got = self.receiver.get(timeout=1.0)
            if got is None:
                if self.receiver.done.is_set():
                    raise RuntimeError("all inference ranks stopped sending rollouts before training finished")
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"no rollouts for {timeout_s:.0f} s (world.timeout_s): are the inference "
                                       "ranks alive?")
                continue
            src, group, stats = got
            self.engine_stats[src] = stats
            gid = group[0].group_id
            key = gid % self.n_engines
            self.max_gid[key] = max(self.max_gid.get(key, -1), gid)
            if rl.filter_zero_advantage and is_zero_advantage_group([s.reward for s in group]):
                self.filtered_total += len(group)
                continue
            for s in group:
                if fresh(s):
                    self.buffer.append(s)
                else:
                    dropped += 1
        batch, self.buffer = self.buffer[:rl.batch_size], self.buffer[rl.batch_size:]
        self.dropped_total += dropped
        return Batch(batch, dropped, time.perf_counter() - t0)

    def drain(self) -> None:
        """After the stop: consume until every inference rank has said DONE (they may be blocked sending)."""
        while not self.receiver.done.is_set() or self.receiver.qsize():
            self.receiver.get(timeout=0.2)
        self.receiver.join()


def run_trainer(cfg: Config, world: World, model_path: str | Path, bucket_bytes: int) -> None:
    rl, tr = cfg.rl, cfg.trainer
    device, group = world.device, world.trainer_group
    n_ranks = len(world.trainer_ranks)
    model = load_hf_model(model_path, device)
    sync_dtype = engine_dtype(cfg, device)
    param_dtype = resolve_param_dtype(tr.param_dtype, device)
    apply_fsdp(model, world.trainer_mesh, param_dtype, DTYPES[tr.reduce_dtype])
    ref_model = None
    if rl.kl_coef > 0:  # the frozen initial policy, sharded like the trained one
        ref_model = load_hf_model(model_path, device).requires_grad_(False)
        apply_fsdp(ref_model, world.trainer_mesh, param_dtype, DTYPES[tr.reduce_dtype])
    optimizer, scheduler = build_optimizer(model.parameters(), tr.lr, tr.betas, tr.eps, tr.weight_decay,
                                           tr.warmup_steps, rl.max_steps, tr.lr_schedule, tr.min_lr_ratio)
    bucket_group = None
    if world.is_main and cfg.inference.engine == "vllm":  # the vLLM workers receive the buckets themselves
        bucket_group = join_store_group(*store_address(), "vllm_weights", 0,
                                        1 + len(world.inference_ranks) * cfg.inference.tensor_parallel_size,
                                        world.backend, device, cfg.world.timeout_s)
    sender = WeightSender(model, world.weight_group, world.trainer_ranks[0], world.is_main, sync_dtype,
                          device, bucket_bytes, bucket_group)
    # The receive queue holds one step's worth of groups: together with the engines' small send queues this
    # bounds how far generation can run ahead of training (and so the lag).
    queue_groups = max(1, rl.batch_size // rl.attempts)
    collector = Collector(RolloutReceiver(world.rollout_group, len(world.inference_ranks), queue_groups), cfg) \
        if world.is_main else None
    logger = MetricsLogger(Path(cfg.job.output_dir) / "rl", cfg.metrics.tensorboard, world.is_main)
    settings = LossSettings(kind=rl.loss, is_clip=rl.is_clip, ppo_eps=rl.ppo_eps, kl_coef=rl.kl_coef)
    tokenizer, task = load_tokenizer(model_path), task_from_config(cfg)
    eval_model = load_hf_model(model_path, device) if rl.eval_every else None

    def evaluate() -> float:
        """Held-out greedy accuracy of the current policy (collective: gather, then split the problems)."""
        assert eval_model is not None
        eval_model.load_state_dict(full_state_dict(model))
        return greedy_accuracy(eval_model, task, tokenizer, cfg.task.max_new_tokens, cfg.tokenizer.use_chat_template,
                               world.trainer_rank, n_ranks, group)

    version = start_step = 0
    ckpt_dir = checkpoint_folder(cfg)
    if cfg.checkpoint.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise ConfigError(f"checkpoint.resume = true but {ckpt_dir} holds no complete checkpoint")
        meta = load_checkpoint(path, model, optimizer, scheduler, group)
        start_step, version = meta["step"], meta["version"]
        if collector is not None:
            collector.dropped_total = meta["dropped_stale"]
        sender.push(version)  # the engines wait for the restored weights before generating
        if world.is_main:
            print(f"[train] resumed from {path} at step {start_step}, version {version}", flush=True)
    prev_engine = {"gen_tokens": 0.0, "busy_s": 0.0, "elapsed_s": 0.0}
    t_prev = time.perf_counter()
    round_batches: list[Batch] = []  # conventional mode: the rest of this round's batches
    for step in range(start_step, rl.max_steps):
        maybe_fail(world.rank, step)
        t_step = time.perf_counter()
        info: list[object] = [None, None]
        if collector is not None:
            if rl.mode == "conventional":
                if not round_batches:  # the whole round's samples first (the engines generate them all, then idle)
                    round_batches = [collector.next_batch(version, cfg.world.timeout_s)
                                     for _ in range(rl.sync_every)]
                    round_batches[0].wait_s = sum(b.wait_s for b in round_batches)
                batch = round_batches.pop(0)
            else:
                batch = collector.next_batch(version, cfg.world.timeout_s)
            info = [split_balanced(batch.samples, n_ranks), batch]
        dist.broadcast_object_list(info, src=world.trainer_ranks[0], group=group)
        parts, batch = info
        assert isinstance(parts, list) and isinstance(batch, Batch)
        mine: list[Sample] = parts[world.trainer_rank]
        t_data = time.perf_counter()

        def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: dict[str, torch.Tensor]):
            ref = mb["ref_logp"][0] if "ref_logp" in mb else None
            loss, s = policy_loss(logp[0], mb["behaviour_logp"][0], mb["advantage"][0], mb["mask"][0],
                                  rl.batch_size, settings, ref)
            s["entropy"] = float((ent[0] * mb["mask"][0]).sum())
            # FSDP averages gradients over ranks; the loss is already normalised by the global B.
            return loss * n_ranks, s

        micro = rl_micro_batches(mine, tr.micro_batch_tokens, device)
        if ref_model is not None:
            add_reference_logprobs(ref_model, micro, cfg.inference.temperature, group, device,
                                   tr.logprob_chunk_size)
        stats = forward_backward(model, micro, loss_fn, cfg.inference.temperature, group, device,
                                 tr.logprob_chunk_size)
        lr = scheduler.get_last_lr()[0]
        grad_norm = clip_and_step(model, optimizer, scheduler, tr.grad_clip)
        version += 1
        push = sender.push(version) if version % rl.sync_every == 0 else None
        keys = ["sum_w", "sum_w2", "tokens", "entropy", "clipped", "kl"]
        sums = dict(zip(keys, sum_over_ranks([stats.get(k, 0.0) for k in keys], group, device)))
        t_end = time.perf_counter()
        last = step + 1 == rl.max_steps
        accuracy = evaluate() if rl.eval_every and ((step + 1) % rl.eval_every == 0 or last) else None
        if collector is not None:
            samples = batch.samples
            lags = [version - 1 - v for s in samples for v in s.versions]
            eng = {k: sum(st[k] for st in collector.engine_stats.values()) for k in prev_engine}
            d_elapsed = max(eng["elapsed_s"] - prev_engine["elapsed_s"], 1e-9)
            values = {
                "version": version,
                "samples": (step + 1) * rl.batch_size,
                "reward_mean": sum(s.reward for s in samples) / len(samples),
                "ess": ess_from_sums(sums["sum_w"], sums["sum_w2"], sums["tokens"]),
                "lag_mean": sum(lags) / max(len(lags), 1),
                "lag_max": max(lags, default=0),
                "current_version_frac": sum(1 for x in lags if x == 0) / max(len(lags), 1),
                # sequences whose tokens come from more than one policy version (in-flight updates)
                "mixed_version_frac": sum(1 for s in samples if len(set(s.versions)) > 1) / len(samples),
                "entropy": sums["entropy"] / max(sums["tokens"], 1.0),
                "is_clipped_frac": sums["clipped"] / max(sums["tokens"], 1.0),
                "kl": sums["kl"] / max(sums["tokens"], 1.0),
                "grad_norm": grad_norm,
                "lr": lr,
                "completion_len": sums["tokens"] / len(samples),
                "gen_tokens_per_s": (eng["gen_tokens"] - prev_engine["gen_tokens"]) / (t_end - t_prev),
                "train_tokens_per_s": sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
                / (t_end - t_data),
                "trainer_busy_frac": (t_end - t_data) / (t_end - t_step),
                "inference_busy_frac": (eng["busy_s"] - prev_engine["busy_s"]) / d_elapsed,
                "update_pause_ms": sum(st["update_pause_ms"] for st in collector.engine_stats.values())
                / max(len(collector.engine_stats), 1),
                "broadcast_mb_per_s": push.mb_per_s if push else float("nan"),
                "wait_for_data_s": batch.wait_s,
                "queue_size": collector.receiver.qsize() + len(collector.buffer),
                "dropped_stale": collector.dropped_total,
                "filtered_zero_adv": collector.filtered_total,
            }
            if accuracy is not None:
                values["eval_accuracy"] = accuracy
            prev_engine = eng
            logger.log(step + 1, values, console=(step + 1) % cfg.metrics.log_every == 0 or step == 0 or last)
        t_prev = t_end
        if cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0:
            meta = {"version": version, "dropped_stale": collector.dropped_total if collector else 0,
                    "stream_next": collector.stream_next() if collector else {}}
            save_checkpoint(ckpt_dir, step + 1, model, optimizer, scheduler, meta, group, world.is_main,
                            cfg.checkpoint.keep)
    sender.stop()
    if collector is not None:
        collector.drain()
    export_policy(model, model_path, Path(cfg.job.output_dir) / "final", world)
    logger.close()


def export_policy(model: torch.nn.Module, init_path: str | Path, out: Path, world: World) -> None:
    """Write the trained policy as an HF folder (weights + config + the initial folder's tokenizer)."""
    full = full_state_dict(model)  # collective over the trainer ranks
    if world.is_main:
        args = model.args  # type: ignore[attr-defined]
        save_hf_folder(out, args, full, dtype=torch.float32)
        load_tokenizer(init_path).save_pretrained(str(out))
        print(f"[train] exported the final policy to {out}", flush=True)
    dist.barrier(group=world.trainer_group)
