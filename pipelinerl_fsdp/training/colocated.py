"""`rl.mode = "colocated"`, the baseline: one process generates with every core, then trains with every core, and
again.

This is the shape single-machine users run today (TRL's trainer, verl's colocated mode): no separate inference
rank, no weight broadcast; the generator reads the trained weights after each optimizer step. It runs the job's
config on the same data, with the pipeline's own parts:
- the same problem stream (`job.seed`), `rl.batch_size / rl.attempts` prompts x `rl.attempts` per step, the task's
  scorer, and the inference loop's group assembly (`rl.groups.group_samples`: rewards, group advantages);
- generation by the project's pure-PyTorch engine (`ReferenceEngine`: batched decode with a KV cache, the job's
  temperature / top-p, stop ids) on an unwrapped copy of the policy in the engines' dtype;
- training by the pipeline trainer's step (`training.rl_step.RLStep`: FSDP2 on a one-rank mesh, packed
  micro-batches, the job's loss, clipping, AdamW and schedule), then the new weights copied into the generator;
- the job's metrics (`step_metrics`: ESS from the engine's and the trainer's log-probs, lag, busy fractions) in
  `<job.output_dir>/rl/metrics.jsonl`, so `benchmarks/learning_speed.py` summarises it like any mode.

    python run_train.py --config arithmetic --rl.mode=colocated --warmstart.path=outputs/warmstart/addition-debug \
        --rl.max_steps=50 --job.output_dir=outputs/colocated

One process, no torchrun (`world.*` and `inference.engine` do not apply). The warm start folder must exist (the
job's warm start stage, or learning_speed.py, makes it). Busy fractions: trainer = the training part of each step,
engine = the engine's own steps in the generation part (they never overlap here). `rl.waves` does not apply: the
whole batch is generated before training starts, so there is nothing for a step in parts to overlap.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.checkpoint_layout import export_folder
from pipelinerl_fsdp.config import Config, ConfigError, JobConfig, LossConfig, RLConfig, TokenizerConfig
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.job.weight_sync import engine_dtype
from pipelinerl_fsdp.models import Transformer
from pipelinerl_fsdp.models.hf_io import load_hf_model, save_hf_folder
from pipelinerl_fsdp.preflight import engine_max_len, sequence_limits, stop_token_ids
from pipelinerl_fsdp.rewards.scorer import Scorer
from pipelinerl_fsdp.rl.groups import group_samples
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.rl.normalization import assign_loss_weights
from pipelinerl_fsdp.rl.step_metrics import StepTimes, step_metrics
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.tasks import ProblemStream, make_task
from pipelinerl_fsdp.tokenizer import completion_text, encode_prompt, load_tokenizer
from pipelinerl_fsdp.training.metrics import MetricsLogger, rl_console
from pipelinerl_fsdp.training.parallelize import (
    DTYPES,
    apply_compile,
    apply_fsdp,
    full_state_dict,
    resolve_compile,
    resolve_fp32_head,
    resolve_param_dtype,
)
from pipelinerl_fsdp.training.policy import build_policy
from pipelinerl_fsdp.training.rl_step import RLStep


@dataclass
class ColocatedParts:
    """The colocated loop's collaborators, built by `run_colocated`."""

    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]
    stream: ProblemStream
    scorer: Scorer
    step: RLStep  # the pipeline trainer's step, on the policy (FSDP2, one rank)
    generator: Transformer  # an unwrapped copy of the policy in the engines' dtype
    engine: ReferenceEngine  # over `generator`
    logger: MetricsLogger


class Colocated:
    """Generate a step's groups, train on them, copy the weights into the generator; `run` loops."""

    def __init__(
        self,
        rl: RLConfig,
        loss: LossConfig,
        fmt: TokenizerConfig,
        max_new_tokens: int,
        log_every: int,
        export_every: int,
        output_dir: Path,
        parts: ColocatedParts,
        slots: int = 0,
    ) -> None:
        # the occupancy's denominator: `inference.max_num_seqs`, as in the split modes (0: no occupancy)
        self.slots = slots
        self.rl, self.loss, self.fmt, self.max_new_tokens = rl, loss, fmt, max_new_tokens
        self.log_every, self.export_every, self.output_dir = log_every, export_every, output_dir
        self.tokenizer, self.stops, self.stream, self.scorer = (
            parts.tokenizer,
            parts.stop_ids,
            parts.stream,
            parts.scorer,
        )
        self.step, self.generator, self.engine, self.logger = parts.step, parts.generator, parts.engine, parts.logger
        self.policy = self.step.policy
        self.version = 0

    def generate(self) -> list[Sample]:
        """One step's groups under the current weights: every attempt of every prompt in one batch."""
        rl = self.rl
        groups = []
        for _ in range(rl.batch_size // rl.attempts):
            gid = self.stream.get_state()["index"]
            problem = next(self.stream)
            ids = encode_prompt(self.tokenizer, problem.prompt, self.fmt)
            reqs = [Request(gid * rl.attempts + a, ids, self.max_new_tokens) for a in range(rl.attempts)]
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
            samples += group_samples(
                gid, ids, reqs, [scores[r.request_id] for r in reqs], rl, self.loss, self.max_new_tokens
            )
        return samples

    def train(self, samples: list[Sample]) -> tuple[LossStats, float]:
        """The job's optimizer step on `samples`, then the new weights into the generator."""
        rl = self.rl
        assign_loss_weights(samples, self.loss, rl.batch_size, rl.attempts, self.max_new_tokens)
        sums, grad_norm = self.step.run([samples], 1, self.version)
        with torch.no_grad():
            theirs = dict(self.generator.named_parameters())
            for name, p in self.policy.model.named_parameters():
                theirs[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        self.version += 1
        self.engine.set_version(self.version)
        return sums, grad_norm

    def export(self, out: Path) -> None:
        """The policy as an HF folder, from the generator's copy where it holds the same fp32 weights (no gather)."""
        gen = self.generator.state_dict()
        # a lower-precision generator (bf16 on GPU) would round the export: then from the policy's fp32 weights
        weights = gen if next(iter(gen.values())).dtype == torch.float32 else full_state_dict(self.policy.model)
        save_hf_folder(out, self.generator.args, weights, dtype=torch.float32)
        self.tokenizer.save_pretrained(str(out))

    def run(self) -> None:
        """`rl.max_steps` steps of generate-then-train, logged like the job's; exports as the job's trainer."""
        rl = self.rl
        before, t_prev = EngineStats(), time.perf_counter()
        t_zero = t_prev
        for step in range(rl.max_steps):
            t_start = time.perf_counter()
            trained_version = self.version
            samples = self.generate()
            t_data = time.perf_counter()
            sums, grad_norm = self.train(samples)
            t_end = time.perf_counter()
            tokens, busy, seq_s = self.engine.stats()
            engines = EngineStats(gen_tokens=float(tokens), busy_s=busy, elapsed_s=t_end - t_zero, seq_s=seq_s)
            times = StepTimes(t_start, t_data, t_end, t_prev)
            values = step_metrics(samples, trained_version, sums, engines, before, times, self.slots)
            values.update(
                {
                    "version": self.version,
                    "samples": (step + 1) * rl.batch_size,
                    "grad_norm": grad_norm,
                    "inference_engines": 1,
                }
            )
            before, t_prev = engines, t_end
            last = step + 1 == rl.max_steps
            self.logger.log(step + 1, values, console=(step + 1) % self.log_every == 0 or step == 0 or last)
            every = self.export_every
            if last or (every and (step + 1) % every == 0):  # as the job's trainer: periodic exports, then final/
                self.export(self.output_dir / "final" if last else export_folder(self.output_dir, step + 1))
        self.logger.close()
        self.scorer.close()


def colocated_device(job: JobConfig) -> torch.device:
    """The job's device rule for one process: its GPU unless `job.device` is "cpu" or there is none."""
    if job.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_colocated(cfg: Config) -> None:
    """The colocated mode: its one-process group, its parts (policy and step, generator and engine, data, metrics)
    and the loop over them."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError("rl.mode = 'colocated' runs in one process: start it without torchrun")
    rl = cfg.rl
    if rl.kl_coef > 0:
        raise ConfigError(f"rl.kl_coef = {rl.kl_coef}: the colocated mode has no reference model; set rl.kl_coef = 0")
    model_path = Path(cfg.warmstart.path)
    if not (model_path / "config.json").is_file():
        raise ConfigError(f"warmstart.path = {model_path}: no HF model folder there (run the job's warm start first)")
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)  # every core for generation, then every core for training
    torch.manual_seed(cfg.job.seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = colocated_device(cfg.job)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)

    tokenizer = load_tokenizer(cfg.tokenizer.path or model_path)
    stops = stop_token_ids(model_path, tokenizer)
    task = make_task(cfg.task)
    model = load_hf_model(model_path, device, torch.float32)
    trainer = cfg.trainer
    param_dtype = resolve_param_dtype(trainer.param_dtype, device)
    if resolve_compile(trainer.compile, device):
        apply_compile(model)
    apply_fsdp(
        model,
        init_device_mesh(device.type, (1,)),
        param_dtype,
        DTYPES[trainer.reduce_dtype],
        resolve_fp32_head(trainer.fp32_head, param_dtype),
    )
    policy = build_policy(model, trainer.optimizer, rl.max_steps)
    step = RLStep(policy, None, cfg.loss, rl.kl_coef, trainer, cfg.inference.temperature, None, device, 1)
    # the engine's dtype (bf16 on GPU, as the job's engines): at lag 0 the ESS then shows what the trainer's
    # precision (trainer.fp32_head) costs against the engine's log-probs
    gen_dtype = engine_dtype(cfg.inference.dtype, device)
    generator = load_hf_model(model_path, device, gen_dtype).eval().requires_grad_(False)
    prompt_len, _ = sequence_limits(cfg.tokenizer, cfg.task, task, tokenizer)
    # built by hand, not by factory.generation_engine (an engine without weight updates): each step's weights are
    # copied into `generator`, the model this engine runs
    engine = ReferenceEngine(
        generator,
        rl.batch_size,
        engine_max_len(cfg.inference, cfg.task, prompt_len),
        stops,
        cfg.inference.temperature,
        cfg.inference.top_p,
        cfg.job.seed,
    )
    out = Path(cfg.job.output_dir)
    logger = MetricsLogger(
        out / "rl",
        cfg.metrics.tensorboard,
        True,
        prefix="rl/",
        total_steps=rl.max_steps,
        console_fields=rl_console(None),
    )
    parts = ColocatedParts(
        tokenizer, stops, ProblemStream(task, cfg.job.seed), task.scorer(), step, generator, engine, logger
    )
    print(f"[colocated] {cores} threads, {rl.max_steps} steps of {rl.batch_size} samples", flush=True)
    run = Colocated(
        rl,
        cfg.loss,
        cfg.tokenizer,
        cfg.task.max_new_tokens,
        cfg.metrics.log_every,
        cfg.checkpoint.export_every,
        out,
        parts,
        cfg.inference.max_num_seqs,
    )
    run.run()
    dist.destroy_process_group()
