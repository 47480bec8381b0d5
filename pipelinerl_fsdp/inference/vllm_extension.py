"""Methods mixed into vLLM's worker class (`worker_extension_cls`), called by `AsyncLLM.collective_rpc`.

They run inside vLLM's worker process, between two engine steps (the engine core executes RPCs between steps,
and the client pauses its scheduler around them). Keep this module light: vLLM imports it in every worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_fsdp.inference.lora_merge import VLLM_PACKED, AdapterMerge, fused_module_name, loaded_weights, read_base
from pipelinerl_fsdp.inference.vllm_load import LOADS, InPlaceLoader, WeightAddresses, graphs_captured
from pipelinerl_fsdp.runtime.faults import maybe_fail
from pipelinerl_fsdp.runtime.processes import parent_of
from pipelinerl_fsdp.transport.store_group import ENGINE_BUCKET_GROUP, join_store_group
from pipelinerl_fsdp.transport.weights import BucketLayout, broadcast_bucket, in_decoder_layer, slot_sizes

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _drop_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" warning, logged on every reload. It is harmless: the
    rotary layer's only tensor is its cos/sin cache, a buffer computed from the config that no checkpoint holds;
    when a reload brings nothing for a layer, vLLM puts the layer's own tensors back (`_place_kernel_tensors`), so
    the cache stays as it was. Any other layer that fails to load still warns."""
    return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


def _watch_rank(rank_pid: int, core_pid: int, period_s: float) -> None:
    """Kill this engine (its core process and this worker) once the inference rank that started it is gone. A rank
    that dies by SIGKILL (OOM killer) or SIGTERM runs no clean-up, and vLLM's processes would outlive the job."""
    while True:
        time.sleep(period_s)
        if parent_of(core_pid) == rank_pid:
            continue
        print(f"[vLLM worker {os.getpid()}] inference rank process {rank_pid} is gone: stopping", flush=True)
        if core_pid != os.getpid():
            os.kill(core_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def output_token_counts(runner: object) -> dict[str, int]:
    """Output tokens sampled so far by every request the worker's model runner holds (vLLM's internal ids), read
    between two engine steps. vLLM 0.32 has two GPU model runners with different private state: V1 (the only one
    on CPU) keeps `requests[rid].output_token_ids` (-1 entries: async-scheduling placeholders, not tokens); V2 (the
    default wherever Triton imports) keeps `req_states`: an index per request, the prompt length on the host and
    the running total length (prompt + output) on the GPU, final once the step's kernels have run (`.cpu()`
    waits for them)."""
    requests = getattr(runner, "requests", None)
    if requests is not None:
        return {rid: sum(1 for t in state.output_token_ids if t >= 0) for rid, state in requests.items()}
    states = getattr(runner, "req_states", None)
    if states is not None:
        rids = list(states.req_id_to_index)
        if not rids:
            return {}
        idx = [states.req_id_to_index[r] for r in rids]
        total = states.total_len.gpu[torch.tensor(idx, device=states.total_len.gpu.device)].cpu().tolist()
        prompt = [int(states.prompt_len.np[i]) for i in idx]
        return {r: int(t) - p for r, t, p in zip(rids, total, prompt)}
    raise RuntimeError(
        f"vLLM's model runner {type(runner).__name__} has neither `requests` (V1) nor `req_states` (V2): this "
        "vLLM version keeps per-request state where the weight update cannot read its version boundaries"
    )


class WeightUpdateExtension:
    """Receives the trainer's weight broadcast straight into this worker and loads it into the running model."""

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
        load: str = "reload",
        prefix: str | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """Join the bucket group as `base_rank + this worker's tensor-parallel rank`; allocate receive buffers;
        load updates the `load` way (`vllm_load.LOADS`); `prefix`: the job attempt's store prefix. `lora`
        (`scaling`, `model_path`, `dtype`, `engine_base`): the updates carry the adapters `names_and_shapes` names,
        merged here into W0, read now from the engine's own HF folder and kept where `engine_base` says
        (inference/lora_merge.py); None: full weights."""
        output_token_counts(self.model_runner)  # a runner whose state we cannot read fails here, at start-up
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._pl_merge, self._pl_merge_layers = None, None
        if lora is not None:
            model = self.model_runner.get_model()
            packed = getattr(type(model), "packed_modules_mapping", None) or VLLM_PACKED
            names = [n for n, _ in names_and_shapes]
            writes = loaded_weights(names, packed)
            base = read_base(lora["model_path"], writes, getattr(torch, lora["dtype"]), device, lora["engine_base"])
            self._pl_merge = AdapterMerge(base, float(lora["scaling"]), names, packed)
            self._pl_merge_layers = {fused_module_name(w, packed) for w in writes}
        self.set_weight_load(load)
        self._pl_layout = BucketLayout(
            [(n, torch.Size(s)) for n, s in names_and_shapes], getattr(torch, dtype), bucket_bytes
        )
        # Streaming: IN_FLIGHT receive buffers, reused round robin while vLLM's loader copies each bucket into the
        # model (buckets hold whole layers, so a layer's tensors are consumed before its buffer is reused).
        # Allocated now, before the first update, at a bounded size (`slot_sizes`).
        self._pl_buffers = [
            torch.empty(n, dtype=self._pl_layout.dtype, device=device) for n in slot_sizes(self._pl_layout.sizes)
        ]
        self._pl_staged: list[torch.Tensor] = []  # async mode only: a whole update kept until it is loaded
        self._pl_device = device
        logging.getLogger(RELOAD_LOGGER).addFilter(_drop_rotary_reload_warning)
        # the graphs were captured at start-up, before this call: the addresses every update must keep
        enforce_eager = bool(getattr(getattr(self, "model_config", None), "enforce_eager", True))
        self._pl_addresses = (
            WeightAddresses(self.model_runner.get_model())
            if graphs_captured(device.type == "cuda", enforce_eager)
            else None
        )
        worker = int(getattr(self, "rank", 0))
        who = f"inference rank {getattr(self, '_pl_rank', -1)}, vLLM worker {worker}"
        self._pl_group = join_store_group(
            host, port, group_name, base_rank + worker, size, backend, device, timeout_s, prefix, who
        )

    def set_weight_load(self, load: str) -> None:
        """How the next updates are loaded: one of `vllm_load.LOADS` (see that module)."""
        if load not in LOADS:
            raise ValueError(f"inference.vllm_weight_load: {load!r} is not one of {LOADS}")
        merge_layers = getattr(self, "_pl_merge_layers", None)
        if load == "reload" and merge_layers is not None:
            raise ValueError("inference.vllm_weight_load = 'reload' cannot load merged LoRA updates: use 'inplace'")
        previous: InPlaceLoader | None = getattr(self, "_pl_inplace", None)
        if previous is not None:
            previous.release()
        self._pl_load = load
        self._pl_inplace = (
            None
            if load == "reload"
            else InPlaceLoader(self.model_runner.get_model(), unpacked=load == "unpacked", layers=merge_layers)
        )

    def watch_inference_rank(self, rank_pid: int, rank: int = -1, period_s: float = 1.0) -> None:
        """Start the watchdog that ends this engine when its inference rank's process dies (`_watch_rank`);
        `rank`: that inference rank's global rank (names this engine in injected faults)."""
        self._pl_rank = rank
        # the engine core is this worker's parent, or this very process when vLLM runs the worker in the core
        core_pid = os.getppid() if parent_of(os.getppid()) == rank_pid else os.getpid()
        if parent_of(core_pid) != rank_pid:
            return  # not the process layout we know (no /proc?): nothing to watch safely
        threading.Thread(target=_watch_rank, args=(rank_pid, core_pid, period_s), daemon=True).start()

    def receive_weight_update(self, load: bool = True, version: int = -1) -> dict[str, int]:
        """Receive one update and load it bucket by bucket as it arrives, or (`load` false, async mode: see
        `load_received_weights`) keep it whole for later. Returns, per scheduled request (vLLM's internal id), how
        many output tokens it had *before* the load: the exact version boundary, since no engine step runs during
        this call."""
        if not load:
            layout = self._pl_layout
            if not self._pl_staged:
                self._pl_staged = [torch.empty(n, dtype=layout.dtype, device=self._pl_device) for n in layout.sizes]
            for flat in self._pl_staged:  # async mode: no marks (the trainer does not watch for stalls there)
                broadcast_bucket(flat, self._pl_group, 0, raw=True)
            return {}
        return self._load(self._streamed(version), version)

    def token_counts(self) -> dict[str, int]:
        """Output tokens so far of every request this worker's runner holds (between two engine steps)."""
        return output_token_counts(self.model_runner)

    def load_received_weights(self) -> dict[str, int]:
        """Load the update kept by `receive_weight_update(load=False)` (token counts as above)."""
        layout = self._pl_layout
        return self._load((v for b, flat in enumerate(self._pl_staged) for v in layout.views(b, flat)), -1)

    def _streamed(self, version: int = -1) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter, each bucket received into the next free buffer when the loader
        asks for its first tensor."""
        layout = self._pl_layout

        def post(b: int) -> tuple[torch.Tensor, dist.Work]:
            flat = self._pl_buffers[b % len(self._pl_buffers)][: layout.sizes[b]]
            work = broadcast_bucket(flat, self._pl_group, 0, raw=True, wait=False)
            assert work is not None
            self._pl_group.mark_posted(version, b)  # while the transfer runs: names this engine if it never comes
            return flat, work

        nxt = post(0)
        for b in range(len(layout.sizes)):
            flat, work = nxt
            t0 = time.perf_counter()
            work.wait()
            self._pl_wait_s += time.perf_counter() - t0
            if b + 1 < len(layout.sizes):
                # the next bucket arrives while vLLM loads this one; its buffer held bucket b - 1, whose layers
                # vLLM processed before asking for this bucket's first tensor
                nxt = post(b + 1)
            if b == 0:
                maybe_fail(getattr(self, "_pl_rank", -1), version, "core-update")
            for name, view in layout.views(b, flat):
                # vLLM processes a module once all of its elements are loaded; the vocabulary layers (embeddings,
                # head: padded to a multiple of 64 rows) never reach that count and are processed at the very end,
                # by which time their buffer holds another bucket: those get a copy of their own ("reload" only:
                # the in-place loads copy every tensor as it comes)
                own = self._pl_load == "reload" and not in_decoder_layer(name)
                yield name, (view.clone() if own else view)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        counts = output_token_counts(self.model_runner)
        t0 = time.perf_counter()
        self._pl_wait_s = 0.0  # the streamed iterator adds its waits as the load consumes it
        merge = getattr(self, "_pl_merge", None)
        if merge is not None:  # adapters in, merged weights out (W0 + s B A), as the stream is consumed
            weights = merge(weights)
        if self._pl_load == "reload":
            # checkpoint format: HF names and shapes; vLLM fuses q/k/v and gate/up and repacks CPU weights itself
            self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            assert self._pl_inplace is not None
            self._pl_inplace.load(weights)
        if self._pl_addresses is not None:
            self._pl_addresses.check(version)
        self._pl_load_s = time.perf_counter() - t0
        return counts

    def last_load_seconds(self) -> tuple[float, float]:
        """Wall seconds of the last `_load`, and of those the seconds spent waiting for buckets to arrive
        (0 for a staged update)."""
        return self._pl_load_s, self._pl_wait_s
