"""The colocated baseline: one process generates with every core, then trains with every core, and again.

This is the shape single-machine users run today (TRL's trainer, verl's colocated mode): no separate inference
rank, no weight broadcast; the generator reads the trained weights after each optimizer step. It takes the job's
config and overrides and runs the same RL step as the job's trainer, on the same data:
- the same problem stream (`job.seed`), `rl.batch_size / rl.attempts` prompts x `rl.attempts` per step, the task's
  scorer and group advantages;
- generation by the project's pure-PyTorch engine (`ReferenceEngine`: batched decode with a KV cache, the job's
  temperature / top-p, stop ids) on an unwrapped copy of the policy in the engines' dtype;
- training by the job's step: FSDP2 (a one-rank mesh), packed micro-batches, the job's loss, clipping, AdamW and
  schedule (`forward_backward`, `Policy.step`), then the new weights copied into the generator's model;
- the job's metrics (`step_metrics`: ESS from the engine's and the trainer's log-probs, lag, busy fractions) in
  `<job.output_dir>/rl/metrics.jsonl`, so `benchmarks/learning_speed.py` summarises it like any mode.

    python benchmarks/colocated.py --config arithmetic.toml --warmstart.path=outputs/warmstart/addition-debug \
        --rl.max_steps=50 --job.output_dir=outputs/colocated

The warm start folder must exist (the job's warm start stage, or learning_speed.py, makes it). Busy fractions:
trainer = the training part of each step, engine = the engine's own steps in the generation part (they never
overlap here). `rl.waves` does not apply: the whole batch is generated before training starts, so there is nothing
for a step in parts to overlap.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipelinerl_fsdp.checkpoint_layout import export_folder
from pipelinerl_fsdp.config import Config
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.placement import engine_dtype
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.models.hf_io import load_hf_model, save_hf_folder
from pipelinerl_fsdp.preflight import engine_max_len, sequence_limits, stop_token_ids
from pipelinerl_fsdp.records import total
from pipelinerl_fsdp.rewards.outcomes import OUTCOME_CODE
from pipelinerl_fsdp.rl.advantages import shaped_group_advantages
from pipelinerl_fsdp.rl.batching import rl_micro_batches
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.rl.normalization import assign_loss_weights
from pipelinerl_fsdp.rl.step_metrics import StepTimes, step_metrics
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.tasks import ProblemStream, make_task
from pipelinerl_fsdp.tokenizer import completion_text, encode_prompt, load_tokenizer
from pipelinerl_fsdp.training.metrics import MetricsLogger, rl_console
from pipelinerl_fsdp.training.parallelize import (
    DTYPES,
    apply_fsdp,
    full_state_dict,
    resolve_fp32_head,
    resolve_param_dtype,
)
from pipelinerl_fsdp.training.policy import build_policy
from pipelinerl_fsdp.training.train_step import forward_backward, rl_loss_fn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Colocated:
    """The policy (FSDP2 on one rank) and a generator over an unwrapped copy of it, in this process."""

    def __init__(self, cfg: Config, model_path: Path) -> None:
        self.cfg = cfg
        rl, device = cfg.rl, colocated_device(cfg)
        self.device = device
        self.tokenizer = load_tokenizer(cfg.tokenizer.path or model_path)
        self.stops = stop_token_ids(model_path, self.tokenizer)
        self.task = make_task(cfg.task)
        self.scorer = self.task.scorer()
        self.stream = ProblemStream(self.task, cfg.job.seed)
        model = load_hf_model(model_path, device, torch.float32)
        param_dtype = resolve_param_dtype(cfg.trainer.param_dtype, device)
        apply_fsdp(
            model,
            init_device_mesh(device.type, (1,)),
            param_dtype,
            DTYPES[cfg.trainer.reduce_dtype],
            resolve_fp32_head(cfg.trainer.fp32_head, param_dtype),
        )
        self.policy = build_policy(model, cfg.trainer.optimizer, rl.max_steps)
        # the engine's dtype (bf16 on GPU, as the job's engines): at lag 0 the ESS then shows what the trainer's
        # precision (trainer.fp32_head) costs against the engine's log-probs
        gen_dtype = engine_dtype(cfg, device)
        self.generator = load_hf_model(model_path, device, gen_dtype).eval().requires_grad_(False)
        prompt_len, _ = sequence_limits(cfg.tokenizer, cfg.task, self.task, self.tokenizer)
        self.engine = ReferenceEngine(
            self.generator,
            rl.batch_size,
            engine_max_len(cfg.inference, cfg.task, prompt_len),
            self.stops,
            cfg.inference.temperature,
            cfg.inference.top_p,
            cfg.job.seed,
        )
        self.version = 0

    def generate(self) -> list[Sample]:
        """One step's groups under the current weights: every attempt of every prompt in one batch."""
        rl = self.cfg.rl
        groups = []
        for _ in range(rl.batch_size // rl.attempts):
            gid = self.stream.get_state()["index"]
            problem = next(self.stream)
            ids = encode_prompt(self.tokenizer, problem.prompt, self.cfg.tokenizer)
            reqs = [Request(gid * rl.attempts + a, ids, self.cfg.task.max_new_tokens) for a in range(rl.attempts)]
            for r in reqs:
                self.engine.add(r)
            groups.append((gid, problem, ids, reqs))
        while self.engine.num_unfinished():
            self.engine.step()
        samples = []
        for gid, problem, ids, reqs in groups:
            for r in reqs:
                self.scorer.submit(
                    r.request_id, completion_text(self.tokenizer, r.tokens, self.stops), problem.answer, r.finished
                )
            scores: dict[int, tuple[float, str]] = {}
            while len(scores) < len(reqs):  # a pooled scorer answers asynchronously
                scores.update({k: (v, o) for k, v, o in self.scorer.ready()})
                if len(scores) < len(reqs):
                    time.sleep(0.001)
            rewards = [scores[r.request_id][0] for r in reqs]
            loss = self.cfg.loss
            advs = shaped_group_advantages(
                rewards,
                [len(r.tokens) for r in reqs],
                rl.baseline,
                rl.std_normalize,
                self.cfg.task.max_new_tokens,
                loss.overlong_buffer,
                loss.overlong_penalty,
            )
            for r, reward, adv in zip(reqs, rewards, advs):
                outcome = OUTCOME_CODE[scores[r.request_id][1]]
                samples.append(Sample(gid, ids, r.tokens, r.logprobs, r.versions, reward, adv, r.finished, outcome))
        return samples

    def train(self, samples: list[Sample]) -> tuple[LossStats, float]:
        """The job's optimizer step on `samples`, then the new weights into the generator."""
        cfg = self.cfg
        assign_loss_weights(samples, cfg.loss, cfg.rl.batch_size, cfg.rl.attempts, cfg.task.max_new_tokens)
        micro = rl_micro_batches(samples, cfg.trainer.micro_batch_tokens, self.device, self.version)
        loss_fn = rl_loss_fn(cfg.loss, cfg.rl.kl_coef, 1)  # the job's step, on one rank
        stats = forward_backward(
            self.policy.model,
            micro,
            loss_fn,
            cfg.inference.temperature,
            None,
            self.device,
            cfg.trainer.logprob_chunk_size,
        )
        grad_norm = self.policy.step()
        with torch.no_grad():
            theirs = dict(self.generator.named_parameters())
            for name, p in self.policy.model.named_parameters():
                theirs[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        self.version += 1
        self.engine.set_version(self.version)
        return total(stats, LossStats()), grad_norm

    def export(self, out: Path) -> None:
        """The policy as an HF folder, from the generator's copy where it holds the same fp32 weights (no gather)."""
        gen = self.generator.state_dict()
        # a lower-precision generator (bf16 on GPU) would round the export: then from the policy's fp32 weights
        weights = gen if next(iter(gen.values())).dtype == torch.float32 else full_state_dict(self.policy.model)
        save_hf_folder(out, self.generator.args, weights, dtype=torch.float32)
        self.tokenizer.save_pretrained(str(out))


def colocated_device(cfg: Config) -> torch.device:
    """The job's device rule for one process: its GPU unless `job.device` is "cpu" or there is none."""
    if cfg.job.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def main(argv: list[str]) -> None:
    cfg = load_config(argv)
    if cfg.rl.kl_coef > 0:
        raise SystemExit("rl.kl_coef > 0: the colocated baseline has no reference model; set rl.kl_coef = 0")
    model_path = Path(cfg.warmstart.path)
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"warmstart.path = {model_path}: no HF model folder there (run the job's warm start first)")
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)  # every core for generation, then every core for training
    torch.manual_seed(cfg.job.seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    on_gpu = colocated_device(cfg).type == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", rank=0, world_size=1)
    run = Colocated(cfg, model_path)
    logger = MetricsLogger(
        Path(cfg.job.output_dir) / "rl",
        cfg.metrics.tensorboard,
        True,
        prefix="rl/",
        total_steps=cfg.rl.max_steps,
        console_fields=rl_console(None),
    )
    print(f"[colocated] {cores} threads, {cfg.rl.max_steps} steps of {cfg.rl.batch_size} samples", flush=True)
    before, t_prev = EngineStats(), time.perf_counter()
    t_zero = t_prev
    for step in range(cfg.rl.max_steps):
        t_start = time.perf_counter()
        trained_version = run.version
        samples = run.generate()
        t_data = time.perf_counter()
        sums, grad_norm = run.train(samples)
        t_end = time.perf_counter()
        tokens, busy, seq_s = run.engine.stats()
        engines = EngineStats(gen_tokens=float(tokens), busy_s=busy, elapsed_s=t_end - t_zero, seq_s=seq_s)
        times = StepTimes(t_start, t_data, t_end, t_prev)
        values = step_metrics(samples, trained_version, sums, engines, before, times, cfg.rl.batch_size)
        values.update({"version": run.version, "samples": (step + 1) * cfg.rl.batch_size, "grad_norm": grad_norm})
        before, t_prev = engines, t_end
        last = step + 1 == cfg.rl.max_steps
        logger.log(step + 1, values, console=(step + 1) % cfg.metrics.log_every == 0 or step == 0 or last)
        every = cfg.checkpoint.export_every
        if last or (every and (step + 1) % every == 0):  # as the job's trainer: periodic exports, then final/
            run.export(Path(cfg.job.output_dir) / "final" if last else export_folder(cfg.job.output_dir, step + 1))
    logger.close()
    run.scorer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
