"""The vLLM engine behind the engine interface: vLLM's `AsyncLLM` with its engine core (and workers) in processes of
its own, driven from an asyncio loop on a background thread. An engine inside this process would adopt torchrun's
already-initialised default process group and deadlock (docs/vllm.md). Weight updates reach the workers directly
(`vllm_extension.WeightUpdateExtension`, over a store-built group with the first trainer rank); the inference
rank's own process only receives the update headers.

Per-token versions with the asynchronous engine (the core runs ahead of this client, so the client's own token
count at the time of an update is not the boundary): an update is `pause_scheduler(keep)` -> RPC -> resume. The
RPC runs inside the worker between two engine steps; *before* loading it reads, for every request the worker
holds, how many output tokens it has sampled so far and returns those counts. Tokens before a request's count
were sampled by the older weights, the rest by the newer ones; a request the worker does not hold yet (queued,
never scheduled) gets count 0. Each request keeps a list of (first token index, version) segments.

Loads go into the running model (`vllm_load.py`: the model's `load_weights` into kept weights by default, or vLLM's
`reload_weights`); either keeps the KV cache of running requests. With `inference.kv_max_age` >= 0 the client tracks,
per request, the version that computed its oldest cached entry (a request the worker holds at an update and had not
held at the one before was prefilled by the weights before this update); when any held request's cache is older than
allowed (`engine.stale_kv`), `reset_prefix_cache(reset_running_requests=True)` during the pause preempts every
running request, and vLLM prefills them again under the new weights when it resumes. vLLM preempts running requests
all together, so the selective rule recomputes all of them when one is stale; it still skips the updates at which
none is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipelinerl_fsdp.inference.busy import BusyClock
from pipelinerl_fsdp.inference.engine import Engine, EngineSettings, Request, stale_kv
from pipelinerl_fsdp.inference.placement import VLLMPlacement, vllm_placement
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.inference.vllm_load import resolve_weight_load
from pipelinerl_fsdp.inference.vllm_options import (
    enforce_eager,
    kv_cache_gib_needed,
    prefill_token_budget,
    sampling_params,
)
from pipelinerl_fsdp.inference.vllm_process import engine_env, quiet_vllm_logs, without_torchrun_env
from pipelinerl_fsdp.models import Transformer, read_model_args
from pipelinerl_fsdp.models.lora import adapter_layout
from pipelinerl_fsdp.transport.store_group import ENGINE_BUCKET_GROUP, store_address, store_prefix
from pipelinerl_fsdp.transport.weights import WeightReceiver

EXTENSION = "pipelinerl_fsdp.inference.vllm_extension.WeightUpdateExtension"
# how often a wait on vLLM checks that its engine core is still alive
LIVENESS_POLL_S = 0.2


def versions_from_segments(segments: list[tuple[int, int]], n: int) -> list[int]:
    """Per-token versions of `n` tokens from (first token index, version) segments in the order they were
    recorded; a later segment overrides an earlier one from its start on."""
    out = [0] * n
    for start, version in segments:
        out[start:] = [version] * max(0, n - start)
    return out


@dataclass
class _Active:
    request: Request
    segments: list[tuple[int, int]]


class VLLMEngine(Engine):
    """vLLM `AsyncLLM` (engine core in its own process) with a synchronous facade for the inference loop.

    `add` submits a request; `step(timeout)` returns the requests that finished since the last call (waiting at
    most `timeout` for one); `load_update(...)` takes a weight update the trainer is broadcasting right now.
    Everything vLLM-facing runs on one asyncio loop in a background thread; the counters below are only touched
    from the caller's thread.
    """

    @classmethod
    def open(cls, settings: EngineSettings) -> VLLMEngine:
        s, world = settings, settings.world
        inf = s.inference
        assert isinstance(inf, VLLMInferenceConfig), "the config loader selects the vLLM section for a vLLM engine"
        model_args = read_model_args(s.model_path)
        if world is not None:
            placement = vllm_placement(inf, s.threads_per_rank, world)
        elif s.device.type == "cuda":
            placement = VLLMPlacement(cpu_cores=None, gpu_ids=[0])
        else:
            placement = VLLMPlacement(cpu_cores=s.cores, gpu_ids=None)
        return cls(
            s.model_path,
            inf.max_num_seqs,
            s.max_len,
            inf.temperature,
            inf.top_p,
            s.seed,
            str(s.dtype).removeprefix("torch."),
            placement,
            inf.kv_cache_gib or kv_cache_gib_needed(model_args, inf.max_num_seqs, s.max_len, s.dtype.itemsize),
            inf.gpu_memory_utilization,
            inf.tensor_parallel_size,
            enforce_eager=enforce_eager(inf.cuda_graphs, on_gpu=s.device.type == "cuda"),
            start_timeout_s=s.timeout_s,
            tokenizer=s.tokenizer_path,
            stop_token_ids=s.stop_token_ids,
            debug=s.debug,
            max_num_batched_tokens=inf.max_num_batched_tokens,
            weight_load=resolve_weight_load(inf.vllm_weight_load, model_args.hidden_size, s.device.type == "cuda"),
        )

    @classmethod
    def create(cls, settings: EngineSettings) -> tuple[VLLMEngine, WeightReceiver]:
        s, world = settings, settings.world
        assert world is not None
        inf = s.inference
        assert isinstance(inf, VLLMInferenceConfig), "the config loader selects the vLLM section for a vLLM engine"
        dtype = str(s.dtype).removeprefix("torch.")
        lora = None
        if s.lora is not None:  # adapters travel (fp32); the workers merge them into W0 (inference/lora_merge.py)
            layout = adapter_layout(read_model_args(s.model_path), s.lora)
            lora = {"scaling": s.lora.scaling, "model_path": str(s.model_path), "dtype": dtype}
            lora["engine_base"] = s.lora.engine_base
            dtype = "float32"
        else:
            with torch.device("meta"):  # names and shapes of the broadcast, in the trainer's order
                layout = [(n, p.shape) for n, p in Transformer(read_model_args(s.model_path)).named_parameters()]
        engine = cls.open(s)
        # header only on this process; the engine's workers join the bucket group with the first trainer rank
        receiver = WeightReceiver(
            layout, world.weight_group, s.weight_src, getattr(torch, dtype), torch.device("cpu"), s.bucket_bytes
        )
        tp = inf.tensor_parallel_size
        engine.join_weight_group(
            *store_address(),
            1 + world.inference_index * tp,
            s.bucket_group_size,
            world.backend,
            s.timeout_s,
            [(n, list(sh)) for n, sh in layout],
            dtype,
            s.bucket_bytes,
            lora=lora,
        )
        return engine, receiver

    def __init__(
        self,
        model_path: str | Path,
        max_num_seqs: int,
        max_len: int,
        temperature: float,
        top_p: float,
        seed: int,
        dtype: str,
        placement: VLLMPlacement,
        kv_cache_gib: float,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        ignore_eos: bool = False,
        start_timeout_s: float = 600,
        tokenizer: str | Path | None = None,
        stop_token_ids: list[int] | None = None,
        debug: bool = False,
        max_num_batched_tokens: int = 0,
        weight_load: str = "reload",
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if not debug:
            # vLLM logs several INFO lines per weight update, warns on every reload and prints ~7 start-up
            # warnings about its own build choices (docs/vllm.md); its processes inherit this environment.
            quiet_vllm_logs()
        os.environ.update(engine_env(placement, os.environ))
        self.temperature, self.top_p, self.seed, self.ignore_eos = temperature, top_p, seed, ignore_eos
        self.stop_token_ids = list(stop_token_ids or [])
        self.weight_load = weight_load  # how the workers load updates (vllm_load.LOADS)
        self.version = 0
        self.generated_tokens = 0
        # busy time and sequence-seconds as vLLM sees its requests: from `add` until vLLM returns the final output
        # (on the client loop), not until the inference loop collects it, which waits while it is blocked on a full
        # send queue; weight-update pauses taken out (busy.py)
        self.busy = BusyClock()
        self._active: dict[str, _Active] = {}  # loop thread only
        self._finished: queue.SimpleQueue[Request | BaseException] = queue.SimpleQueue()
        self._n_unfinished = 0  # added and not yet returned by `step` (the caller's thread)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-client", daemon=True)
        self._thread.start()
        kwargs = dict(
            model=str(model_path),
            tokenizer=str(tokenizer or model_path),
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            # processed: log-probs of the sampling distribution (after temperature / top-p), which
            # the trainer's importance weights need; vLLM's default (raw) ignores the temperature.
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            # one step in flight at a time: the worker's token counts are then final (exact versions)
            async_scheduling=False,
            disable_log_stats=True,
            use_tqdm_on_load=debug,  # the loading progress bars: with job.debug only
            # a cached prompt prefix would carry KV of older weights into a request tagged with the
            # current version; prompts are short next to completions, so exactness wins here
            enable_prefix_caching=False,
        )
        if placement.gpu_ids is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:  # an explicit size also spares vLLM's CPU worker a warm-up pass to measure free memory
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        budget = max_num_batched_tokens or prefill_token_budget(max_num_seqs, max_len, placement.gpu_ids is not None)
        if budget:
            kwargs["max_num_batched_tokens"] = budget
        # every call into vLLM below waits at most this long (and much less once the engine core is dead)
        self.timeout_s = start_timeout_s
        with without_torchrun_env():  # vLLM's processes are not ranks of our job
            self.llm = self._call(self._start(kwargs), "vLLM's start-up")
        # vLLM's processes end with this one, even when it is killed without a chance to close them
        rank = int(os.environ.get("RANK", "-1"))
        self._call(self.llm.collective_rpc("watch_inference_rank", args=(os.getpid(), rank)), "the workers' watchdog")

    # -- loop-thread side ---------------------------------------------------------------------------------------
    def _call(self, coro: Any, what: str, timeout: float | None = None, check_alive: bool = True) -> Any:
        """Run `coro` on the client loop and wait for its result: at most `timeout` s (default: the engine's
        `timeout_s`), and, with `check_alive`, no longer than vLLM takes to notice that its engine core died.
        vLLM fails new calls on a dead core but never answers one already in flight (a weight update's RPC
        would wait forever), so liveness is polled here. Errors name `what` was waited for."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not concurrent.futures.wait([fut], timeout=LIVENESS_POLL_S).done:
            llm = getattr(self, "llm", None)
            if check_alive and llm is not None and llm.errored:
                fut.cancel()
                raise RuntimeError(f"vLLM's engine core died during {what}") from llm.dead_error
            if time.monotonic() > deadline:
                fut.cancel()
                raise TimeoutError(
                    f"no answer from vLLM's engine core for {limit:.0f} s (world.timeout_s) during {what}"
                )
        return fut.result()

    @staticmethod
    async def _start(kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def _generate(self, request: Request) -> None:
        rid = str(request.request_id)
        self._active[rid] = _Active(request, [(0, self.version)])
        try:
            temperature = self.temperature if request.temperature is None else request.temperature
            top_p = self.top_p if request.top_p is None else request.top_p
            params = sampling_params(request, temperature, top_p, self.seed, self.ignore_eos, self.stop_token_ids)
            final = None
            async for out in self.llm.generate({"prompt_token_ids": list(request.prompt_ids)}, params, rid):
                final = out
            assert final is not None and final.finished, f"vLLM request {rid} ended without a final output"
            comp = final.outputs[0]
            request.tokens = list(comp.token_ids)
            request.logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, request.tokens)]
            request.versions = versions_from_segments(self._active[rid].segments, len(request.tokens))
            request.finished = comp.finish_reason == "stop"  # a stop token, not max_tokens
            self._finished.put(request)
        except BaseException as e:  # surfaces in the caller's `step()`: a dead engine must stop the job
            self._finished.put(e)
        finally:
            self.busy.leave()
            self._active.pop(rid, None)

    async def _update(self, version: int, kv_max_age: int, staged: bool = False) -> int:
        """Pause, load the update (received now, or `staged` earlier) in the workers, recompute stale KV caches,
        resume. Returns the number of sequences whose cache was recomputed."""
        # Straight to the core: AsyncLLM.pause_generation adds a fixed 20 ms sleep for output ordering we don't need.
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        recomputed = 0
        try:
            rpc = (
                self.llm.collective_rpc("load_received_weights")
                if staged
                else self.llm.collective_rpc("receive_weight_update", args=(True, version))
            )
            counts = (await rpc)[0]
            by_id = {internal.rsplit("-", 1)[0]: n for internal, n in counts.items()}  # internal: "<ours>-<hex>"
            held = [a.request for rid, a in self._active.items() if rid in by_id]
            for r in held:
                if r.kv_version < 0:  # prefilled since the last update: by the weights before this one
                    r.kv_version = self.version
            if any(stale_kv([r.kv_version for r in held], version, kv_max_age)):
                # preempts every running request; they are prefilled again under the new weights on resume
                await self.llm.reset_prefix_cache(reset_running_requests=True)
                for r in held:
                    r.kv_version = version
                recomputed = len(held)
        finally:
            await self.llm.resume_generation()
        for rid, active in self._active.items():
            active.segments.append((by_id.get(rid, 0), version))
        self.version = version
        return recomputed

    # -- caller side --------------------------------------------------------------------------------------------
    def join_weight_group(
        self,
        host: str,
        port: int,
        base_rank: int,
        size: int,
        backend: str,
        timeout_s: float,
        names_and_shapes: list[tuple[str, list[int]]],
        dtype: str,
        bucket_bytes: int,
        group_name: str = ENGINE_BUCKET_GROUP,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """Have every worker of this engine join the bucket group (blocks until all members have joined); `lora`:
        the updates carry adapters (`WeightUpdateExtension.join_weight_group`)."""
        self._call(
            self.llm.collective_rpc(
                "join_weight_group",
                args=(
                    host,
                    port,
                    base_rank,
                    size,
                    backend,
                    timeout_s,
                    names_and_shapes,
                    dtype,
                    bucket_bytes,
                    group_name,
                    self.weight_load,
                    store_prefix(),  # the workers do not see torchrun's environment (without_torchrun_env)
                    lora,
                ),
            ),
            "joining the weight-update group",
        )

    def set_weight_load(self, load: str) -> None:
        """Switch how the workers load the next updates (`vllm_load.LOADS`); benchmarks compare the ways."""
        self._call(self.llm.collective_rpc("set_weight_load", args=(load,)), "switching the weight load")
        self.weight_load = load

    def last_load_seconds(self) -> tuple[float, float]:
        """The first worker's last load: wall seconds, and of those the seconds waiting for buckets."""
        return tuple(self._call(self.llm.collective_rpc("last_load_seconds"), "the last load's timing")[0])

    def add(self, request: Request) -> None:
        self.busy.enter()
        self._n_unfinished += 1
        asyncio.run_coroutine_threadsafe(self._generate(request), self.loop)

    def num_unfinished(self) -> int:
        return self._n_unfinished

    def tokens_in_flight(self) -> list[int]:
        """Output tokens so far of each request vLLM's (first) worker holds, read between two engine steps."""
        return list(self._call(self.llm.collective_rpc("token_counts"), "the in-flight token counts")[0].values())

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
        return done  # type: ignore[return-value]

    def stats(self) -> tuple[int, float, float]:
        """Busy: time vLLM holds at least one unfinished request, less the update pauses (`busy.BusyClock`)."""
        busy, seq_s = self.busy.read()
        return self.generated_tokens, busy, seq_s

    def load_update(self, receiver: WeightReceiver, version: int, kv_max_age: int) -> int:
        """The workers receive the buckets and load them (`receiver` only carried the header)."""
        self.busy.pause()
        try:
            return self._call(self._update(version, kv_max_age), f"the update to version {version}")
        finally:
            self.busy.resume()

    async def _shutdown(self) -> None:
        self.llm.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stage_update(self, receiver: WeightReceiver) -> None:
        """Into the workers' receive buffers (the RPC runs between two engine steps; generation goes on with the
        current weights)."""
        self.busy.pause()
        try:
            self._call(self.llm.collective_rpc("receive_weight_update", args=(False,)), "receiving an update")
        finally:
            self.busy.resume()

    def apply_staged(self, version: int) -> None:
        self.busy.pause()
        try:
            # async mode loads only when no request is in flight: no cache to keep or recompute
            self._call(self._update(version, -1, staged=True), f"loading the staged version {version}")
        finally:
            self.busy.resume()

    def close(self) -> None:
        """Stop the engine's processes and the client loop (unfinished requests are dropped)."""
        self._call(self._shutdown(), "the engine's shutdown", timeout=60, check_alive=False)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
