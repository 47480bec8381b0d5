"""The inference-rank loop: keep the engine full of prompt groups, take in-flight weight updates between two engine
steps, score finished groups (reward + group advantage: the preprocessor stage) and queue them to the trainer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelinerl_fsdp.checkpoint import latest_checkpoint, read_meta
from pipelinerl_fsdp.config import Config, ConfigError, checkpoint_folder
from pipelinerl_fsdp.evaluation import completion_text
from pipelinerl_fsdp.faults import maybe_fail
from pipelinerl_fsdp.inference.engine import ReferenceEngine, Request
from pipelinerl_fsdp.models import load_hf_model
from pipelinerl_fsdp.rl.advantages import group_advantages
from pipelinerl_fsdp.tasks import Problem
from pipelinerl_fsdp.tasks.arithmetic import ProblemStream
from pipelinerl_fsdp.tokenizer import encode_prompt, load_tokenizer
from pipelinerl_fsdp.transport.rollouts import RolloutSender, Sample
from pipelinerl_fsdp.transport.weights import STOP, WeightReceiver
from pipelinerl_fsdp.warmstart import task_from_config
from pipelinerl_fsdp.world import World


@dataclass
class _Group:
    problem: Problem
    prompt_ids: list[int]
    done: list[Request] = field(default_factory=list)


class InferenceWorker:
    def __init__(self, cfg: Config, world: World, model_path: str | Path, bucket_bytes: int) -> None:
        self.cfg, self.world = cfg, world
        self.tokenizer = load_tokenizer(model_path)
        self.task = task_from_config(cfg)
        model = load_hf_model(model_path, world.device)
        inf = cfg.inference
        prompt_len = max(len(encode_prompt(self.tokenizer, p.prompt, cfg.tokenizer.use_chat_template))
                         for p in self.task.eval_split())
        self.engine = ReferenceEngine(model, inf.max_num_seqs, 2 * prompt_len + cfg.task.max_new_tokens,
                                      [self.tokenizer.eos_token_id], inf.temperature, inf.top_p,
                                      seed=cfg.job.seed * 1000 + world.rank)
        src = world.trainer_ranks[0]
        params = self.engine.params
        self.receiver = WeightReceiver([(n, p.shape) for n, p in params.items()], world.weight_group, src,
                                       next(model.parameters()).dtype, world.device, bucket_bytes)
        self.receiver.bind(params)  # updates land straight in the engine's weights
        self.sender = RolloutSender(world.rollout_group, src, inf.max_queued_groups)
        n_inf = len(world.inference_ranks)
        self.stream = ProblemStream(self.task, cfg.job.seed, offset=world.inference_index, stride=n_inf)
        self.groups: dict[int, _Group] = {}
        self._next_gid = world.inference_index
        self._gid_stride = n_inf
        self.stats = {"gen_tokens": 0.0, "busy_s": 0.0, "elapsed_s": 0.0, "update_pause_ms": 0.0}
        self._t0 = time.perf_counter()
        self.stopped = False
        if cfg.checkpoint.resume:
            self._resume()

    def _resume(self) -> None:
        """Continue the prompt stream after the groups the checkpoint had seen; wait for its weights."""
        path = latest_checkpoint(checkpoint_folder(self.cfg))
        if path is None:
            raise ConfigError(f"checkpoint.resume = true but {checkpoint_folder(self.cfg)} holds no checkpoint")
        nxt = read_meta(path)["stream_next"].get(str(self.world.inference_index))
        if nxt is not None:
            self.stream.reset({"index": nxt})
            self._next_gid = nxt
        kind, version = self.receiver.receive()  # the trainer pushes the restored weights first
        if kind == STOP:
            self.stopped = True
        self.engine.set_version(version)

    def _service_update(self) -> None:
        """If a weight update (or stop) has arrived, take it now: this runs only between two engine steps."""
        if self.stopped or not self.receiver.pending():
            return
        t0 = time.perf_counter()
        kind, version = self.receiver.receive()
        if kind == STOP:
            self.stopped = True
            return
        self.engine.set_version(version)
        if self.cfg.inference.recompute_kv_on_update:
            self.engine.recompute_kv()
        self.stats["update_pause_ms"] = (time.perf_counter() - t0) * 1000

    def _add_group(self) -> None:
        problem = next(self.stream)
        ids = encode_prompt(self.tokenizer, problem.prompt, self.cfg.tokenizer.use_chat_template)
        gid = self._next_gid
        self._next_gid += self._gid_stride
        self.groups[gid] = _Group(problem, ids)
        for a in range(self.cfg.rl.attempts):
            self.engine.add(Request(gid * self.cfg.rl.attempts + a, ids, self.cfg.task.max_new_tokens))

    def _finish(self, req: Request) -> None:
        gid = req.request_id // self.cfg.rl.attempts
        g = self.groups[gid]
        g.done.append(req)
        if len(g.done) < self.cfg.rl.attempts:
            return
        del self.groups[gid]
        rl = self.cfg.rl
        rewards = [self.task.reward(g.problem, completion_text(self.tokenizer, r.tokens)) for r in g.done]
        advs = group_advantages(rewards, rl.baseline, rl.std_normalize)
        samples = [Sample(gid, g.prompt_ids, r.tokens, r.logprobs, r.versions, rw, a, r.finished)
                   for r, rw, a in zip(g.done, rewards, advs)]
        # Backpressure: wait while the queue is full, but keep taking weight updates meanwhile.
        while not self.stopped:
            self.stats["elapsed_s"] = time.perf_counter() - self._t0
            if self.sender.put(samples, self.stats, timeout=0.05):
                return
            self._service_update()

    def run(self) -> None:
        attempts, cap = self.cfg.rl.attempts, self.cfg.inference.max_num_seqs
        n_steps = 0
        while not self.stopped:
            maybe_fail(self.world.rank, n_steps)
            n_steps += 1
            self._service_update()
            if self.stopped:
                break
            while self.engine.num_unfinished() + attempts <= cap:
                self._add_group()
            t0 = time.perf_counter()
            finished = self.engine.step()
            self.stats["busy_s"] += time.perf_counter() - t0
            # every request still running after the step, and every one that finished in it, sampled a token
            self.stats["gen_tokens"] += len(self.engine.running) + len(finished)
            for r in finished:
                self._finish(r)
        self.sender.close()


def run_inference(cfg: Config, world: World, model_path: str | Path, bucket_bytes: int) -> None:
    torch.manual_seed(cfg.job.seed + world.rank)
    InferenceWorker(cfg, world, model_path, bucket_bytes).run()
