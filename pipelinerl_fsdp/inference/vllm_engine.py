"""vLLM engines behind the reference engine's interface (`add`, `step`, `num_unfinished`, ...).

Two arrangements:

* `VLLMEngine`: the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); `step()` advances it by
  exactly one engine step, so the tokens a step returns carry the version of the weights that step ran with.
  For tests and benchmarks in a plain process: an in-process engine adopts torchrun's already-initialised
  default process group and deadlocks (FIELD_NOTES), so it cannot run inside the job.
* `AsyncVLLMEngine`: what the job's inference ranks run. vLLM's `AsyncLLM` with its engine core (and workers) in
  processes of its own, driven from an asyncio loop on a background thread. Weight updates reach the workers
  directly (`vllm_extension.WeightUpdateExtension`, over a store-built group with the first trainer rank).

Per-token versions with the asynchronous engine (the core runs ahead of this client, so the client's own token
count at the time of an update is not the boundary): an update is `pause_scheduler(keep)` -> RPC -> resume. The
RPC runs inside the worker between two engine steps; *before* loading it reads, for every request the worker
holds, how many output tokens it has sampled so far and returns those counts. Tokens before a request's count
were sampled by the older weights, the rest by the newer ones; a request the worker does not hold yet (queued,
never scheduled) gets count 0. Each request keeps a list of (first token index, version) segments.

Loads go through vLLM's `reload_weights` (on CPU vLLM repacks linear weights after loading, so copying into
parameters would silently do nothing); it keeps the KV cache of running requests. The recompute switch pauses
with `clear_cache=True`, which preempts running requests so they are prefilled again under the new weights.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipelinerl_fsdp.inference.engine import Request

EXTENSION = "pipelinerl_fsdp.inference.vllm_extension.WeightUpdateExtension"


class VLLMEngine:
    def __init__(self, model_path: str | Path, max_num_seqs: int, max_len: int, temperature: float,
                 top_p: float = 1.0, seed: int = 0, dtype: str = "float32", enforce_eager: bool = True,
                 ignore_eos: bool = False) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        # processed_logprobs: log-probs under the sampling distribution (after temperature / top-p), which is
        # what the trainer's importance weights need; vLLM's default (raw) ignores the temperature.
        self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_len, max_num_seqs=max_num_seqs,
                       seed=seed, enforce_eager=enforce_eager, logprobs_mode="processed_logprobs")
        self.core = self.llm.llm_engine
        self.temperature, self.top_p, self.seed, self.ignore_eos = temperature, top_p, seed, ignore_eos
        self.version = 0
        self.requests: dict[str, Request] = {}
        self.generated_tokens, self.busy_s = 0, 0.0

    def add(self, request: Request) -> None:
        params = sampling_params(request, self.temperature, self.top_p, self.seed, self.ignore_eos)
        rid = str(request.request_id)
        self.core.add_request(rid, {"prompt_token_ids": list(request.prompt_ids)}, params)
        self.requests[rid] = request

    def num_unfinished(self) -> int:
        return len(self.requests)

    def busy_seconds(self) -> float:
        return self.busy_s

    def step(self) -> list[Request]:
        """One engine step; new tokens are tagged with the current version. Returns finished requests."""
        t0 = time.perf_counter()
        finished = []
        for out in self.core.step():
            req = self.requests[out.request_id]
            comp = out.outputs[0]
            n_old = len(req.tokens)
            new = list(comp.token_ids)[n_old:]
            req.tokens.extend(new)
            req.logprobs.extend(lp[t].logprob for lp, t in zip(comp.logprobs[n_old:], new))
            req.versions.extend([self.version] * len(new))
            self.generated_tokens += len(new)
            if out.finished:
                req.finished = comp.finish_reason == "stop"
                finished.append(req)
                del self.requests[out.request_id]
        self.busy_s += time.perf_counter() - t0
        return finished

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors between two steps (whole layers together: q/k/v and gate/up are fused)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named, "is_checkpoint_format": True})

    def set_version(self, version: int) -> None:
        self.version = version


def sampling_params(request: Request, temperature: float, top_p: float, seed: int, ignore_eos: bool,
                    final_only: bool = False) -> Any:
    """vLLM sampling parameters of one request: the sampled token's log-prob (`logprobs=0`), a per-request seed."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=request.max_tokens, logprobs=0,
                          ignore_eos=ignore_eos, seed=seed * 1_000_003 + request.request_id, output_kind=kind)


def versions_from_segments(segments: list[tuple[int, int]], n: int) -> list[int]:
    """Per-token versions of `n` tokens from (first token index, version) segments in the order they were
    recorded; a later segment overrides an earlier one from its start on."""
    out = [0] * n
    for start, version in segments:
        out[start:] = [version] * max(0, n - start)
    return out


@dataclass
class VLLMPlacement:
    """Where an engine runs: CPU cores for vLLM's OpenMP threads, or GPU indices (one per tensor-parallel rank)."""
    cpu_cores: str | None  # VLLM_CPU_OMP_THREADS_BIND value, e.g. "1" or "0-3|4-7"; None: vLLM's own choice
    gpu_ids: list[int] | None  # CUDA_VISIBLE_DEVICES of the engine; None on CPU


@dataclass
class _Active:
    request: Request
    segments: list[tuple[int, int]]


class AsyncVLLMEngine:
    """vLLM `AsyncLLM` (engine core in its own process) with a synchronous facade for the inference loop.

    `add` submits a request; `step(timeout)` returns the requests that finished since the last call (waiting at
    most `timeout` for one); `update(version, recompute)` takes a weight update the trainer is broadcasting right
    now. Everything vLLM-facing runs on one asyncio loop in a background thread; the counters below are only
    touched from the caller's thread.
    """

    def __init__(self, model_path: str | Path, max_num_seqs: int, max_len: int, temperature: float, top_p: float,
                 seed: int, dtype: str, placement: VLLMPlacement, kv_cache_gib: int,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 ignore_eos: bool = False, start_timeout_s: float = 600) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if placement.gpu_ids is None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
            if placement.cpu_cores:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = placement.cpu_cores
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.gpu_ids))
        self.temperature, self.top_p, self.seed, self.ignore_eos = temperature, top_p, seed, ignore_eos
        self.version = 0
        self.generated_tokens, self.busy_s, self.pause_s = 0, 0.0, 0.0
        self._active: dict[str, _Active] = {}  # loop thread only
        self._finished: queue.SimpleQueue[Request | BaseException] = queue.SimpleQueue()
        self._n_unfinished = 0
        self._busy_since: float | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-client", daemon=True)
        self._thread.start()
        kwargs = dict(model=str(model_path), dtype=dtype, max_model_len=max_len, max_num_seqs=max_num_seqs,
                      seed=seed, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                      # processed: log-probs of the sampling distribution (after temperature / top-p), which
                      # the trainer's importance weights need; vLLM's default (raw) ignores the temperature.
                      logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
                      # one step in flight at a time: the worker's token counts are then final (exact versions)
                      async_scheduling=False, disable_log_stats=True,
                      # a cached prompt prefix would carry KV of older weights into a request tagged with the
                      # current version; prompts are short next to completions, so exactness wins here
                      enable_prefix_caching=False)
        if placement.gpu_ids is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.llm = self._call(self._start(kwargs), start_timeout_s)

    # -- loop-thread side ---------------------------------------------------------------------------------------
    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    async def _start(kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def _generate(self, request: Request) -> None:
        rid = str(request.request_id)
        self._active[rid] = _Active(request, [(0, self.version)])
        try:
            params = sampling_params(request, self.temperature, self.top_p, self.seed, self.ignore_eos,
                                     final_only=True)
            final = None
            async for out in self.llm.generate({"prompt_token_ids": list(request.prompt_ids)}, params, rid):
                final = out
            assert final is not None and final.finished, f"vLLM request {rid} ended without a final output"
            comp = final.outputs[0]
            request.tokens = list(comp.token_ids)
            request.logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, request.tokens)]
            request.versions = versions_from_segments(self._active[rid].segments, len(request.tokens))
            request.finished = comp.finish_reason == "stop"
            self._finished.put(request)
        except BaseException as e:  # surfaces in the caller's `step()`: a dead engine must stop the job
            self._finished.put(e)
        finally:
            self._active.pop(rid, None)

    async def _update(self, version: int, recompute: bool, method: str = "receive_weight_update") -> None:
        # Straight to the core: AsyncLLM.pause_generation adds a fixed 20 ms sleep for output ordering we don't need.
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=recompute)
        try:
            counts = (await self.llm.collective_rpc(method))[0]
        finally:
            await self.llm.resume_generation()
        by_id = {internal.rsplit("-", 1)[0]: n for internal, n in counts.items()}  # internal ids: "<ours>-<hex>"
        for rid, active in self._active.items():
            active.segments.append((by_id.get(rid, 0), version))
        self.version = version

    # -- caller side --------------------------------------------------------------------------------------------
    def join_weight_group(self, host: str, port: int, base_rank: int, size: int, backend: str, timeout_s: float,
                          names_and_shapes: list[tuple[str, list[int]]], dtype: str, bucket_bytes: int,
                          group_name: str = "vllm_weights") -> None:
        """Have every worker of this engine join the bucket group (blocks until all members have joined)."""
        self._call(self.llm.collective_rpc("join_weight_group", args=(
            host, port, base_rank, size, backend, timeout_s, names_and_shapes, dtype, bucket_bytes, group_name)))

    def add(self, request: Request) -> None:
        if self._n_unfinished == 0:
            self._busy_since = time.perf_counter()
        self._n_unfinished += 1
        asyncio.run_coroutine_threadsafe(self._generate(request), self.loop)

    def num_unfinished(self) -> int:
        return self._n_unfinished

    def step(self, timeout: float = 0.005) -> list[Request]:
        """Requests finished since the last call (waits up to `timeout` for the first). Raises the engine's error."""
        done = []
        try:
            done.append(self._finished.get(timeout=timeout))
            while True:
                done.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        for r in done:
            if isinstance(r, BaseException):
                raise RuntimeError("vLLM engine failed") from r
        self._n_unfinished -= len(done)
        self.generated_tokens += sum(len(r.tokens) for r in done)  # type: ignore[union-attr]
        if self._n_unfinished == 0 and self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
        return done  # type: ignore[return-value]

    def busy_seconds(self) -> float:
        """Time with at least one request in the engine, less the update pauses."""
        running = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + running - self.pause_s

    def update(self, version: int, recompute: bool) -> None:
        """Take the update whose header just arrived: the workers receive the buckets and load them."""
        t0 = time.perf_counter()
        self._call(self._update(version, recompute))
        if self._busy_since is not None:  # only a pause while busy is idle time to subtract
            self.pause_s += time.perf_counter() - max(t0, self._busy_since)

    async def _shutdown(self) -> None:
        self.llm.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stage_update(self) -> None:
        """Receive the update whose header just arrived into the workers' buffers without loading it (the RPC runs
        between two engine steps; generation goes on with the current weights)."""
        t0 = time.perf_counter()
        self._call(self.llm.collective_rpc("receive_weight_update", args=(False,)))
        if self._busy_since is not None:
            self.pause_s += time.perf_counter() - max(t0, self._busy_since)

    def apply_staged(self, version: int) -> None:
        """Load the staged update; later tokens carry `version`."""
        self._call(self._update(version, False, "load_received_weights"))

    def close(self) -> None:
        """Stop the engine's processes and the client loop (unfinished requests are dropped)."""
        self._call(self._shutdown(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
