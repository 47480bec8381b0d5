"""The inference-rank loop: keep the engine full of prompt groups, take in-flight weight updates between two engine
steps, score finished groups (reward + group advantage: the preprocessor stage) and queue them to the trainer.

The engine is vLLM (`AsyncVLLMEngine`: its workers receive the weight buckets themselves) or the reference engine
(the buckets land in its parameters here); either way this loop polls the update header between engine steps."""

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
from pipelinerl_fsdp.inference.placement import engine_dtype, vllm_placement
from pipelinerl_fsdp.inference.vllm_engine import AsyncVLLMEngine
from pipelinerl_fsdp.models import Transformer, load_hf_model, read_model_args
from pipelinerl_fsdp.rl.advantages import group_advantages
from pipelinerl_fsdp.tasks import Problem
from pipelinerl_fsdp.tasks.arithmetic import ProblemStream
from pipelinerl_fsdp.tokenizer import encode_prompt, load_tokenizer
from pipelinerl_fsdp.transport.rollouts import RolloutSender, Sample
from pipelinerl_fsdp.transport.store_group import store_address
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
        inf = cfg.inference
        prompt_len = max(len(encode_prompt(self.tokenizer, p.prompt, cfg.tokenizer.use_chat_template))
                         for p in self.task.eval_split())
        max_len = 2 * prompt_len + cfg.task.max_new_tokens
        seed = cfg.job.seed * 1000 + world.rank
        src = world.trainer_ranks[0]
        dtype = engine_dtype(cfg, world.device if inf.engine == "reference" else
                             torch.device("cuda" if world.backend == "nccl" else "cpu"))
        self.engine: ReferenceEngine | AsyncVLLMEngine
        if inf.engine == "vllm":
            with torch.device("meta"):  # names and shapes of the broadcast, in the trainer's order
                layout = [(n, p.shape) for n, p in Transformer(read_model_args(model_path)).named_parameters()]
            self.engine = AsyncVLLMEngine(model_path, inf.max_num_seqs, max_len, inf.temperature, inf.top_p, seed,
                                          str(dtype).removeprefix("torch."), vllm_placement(cfg, world),
                                          inf.kv_cache_gib, inf.gpu_memory_utilization, inf.tensor_parallel_size,
                                          start_timeout_s=cfg.world.timeout_s)
            # header only on this process; the engine's workers join the bucket group with the first trainer rank
            self.receiver = WeightReceiver(layout, world.weight_group, src, dtype, torch.device("cpu"), bucket_bytes)
            tp = inf.tensor_parallel_size
            self.engine.join_weight_group(*store_address(), 1 + world.inference_index * tp,
                                          1 + len(world.inference_ranks) * tp, world.backend, cfg.world.timeout_s,
                                          [(n, list(s)) for n, s in layout], str(dtype).removeprefix("torch."),
                                          bucket_bytes)
        else:
            model = load_hf_model(model_path, world.device, dtype)
            self.engine = ReferenceEngine(model, inf.max_num_seqs, max_len, [self.tokenizer.eos_token_id],
                                          inf.temperature, inf.top_p, seed=seed)
            params = self.engine.params
            self.receiver = WeightReceiver([(n, p.shape) for n, p in params.items()], world.weight_group, src,
                                           dtype, world.device, bucket_bytes)
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
        self._take_update()  # the trainer pushes the restored weights first

    def _take_update(self) -> None:
        """Receive the update (or stop) whose header has arrived, or block until one does."""
        t0 = time.perf_counter()
        recompute = self.cfg.inference.recompute_kv_on_update
        if isinstance(self.engine, AsyncVLLMEngine):
            kind, version = self.receiver.wait_header()
            if kind == STOP:
                self.stopped = True
                return
            self.engine.update(version, recompute)  # its workers receive the buckets and reload
            self.receiver.post()
        else:
            kind, version = self.receiver.receive()  # into the engine's own parameters
            if kind == STOP:
                self.stopped = True
                return
            self.engine.set_version(version)
            if recompute:
                self.engine.recompute_kv()
        self.stats["update_pause_ms"] = (time.perf_counter() - t0) * 1000

    def _service_update(self) -> None:
        """If a weight update (or stop) has arrived, take it now: this runs only between two engine steps."""
        if not self.stopped and self.receiver.pending():
            self._take_update()

    def _snapshot_stats(self) -> None:
        """Engine counters and wall time read together: the trainer turns their deltas into rates and fractions
        (a vLLM engine keeps generating while this loop waits on backpressure, so a stale read would skew them)."""
        self.stats["busy_s"] = self.engine.busy_seconds()
        self.stats["gen_tokens"] = float(self.engine.generated_tokens)
        self.stats["elapsed_s"] = time.perf_counter() - self._t0

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
            self._snapshot_stats()
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
            finished = self.engine.step()
            for r in finished:
                self._finish(r)
        self.sender.close()
        if isinstance(self.engine, AsyncVLLMEngine):
            self.engine.close()


def run_inference(cfg: Config, world: World, model_path: str | Path, bucket_bytes: int) -> None:
    torch.manual_seed(cfg.job.seed + world.rank)
    InferenceWorker(cfg, world, model_path, bucket_bytes).run()
