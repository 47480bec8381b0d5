"""The pure-PyTorch reference generation engine: continuous batching over a slot KV cache, in-flight weight loads.

Requests wait until a slot is free, are prefilled (several packed in one forward), then advance one token per
`step()` together; finished requests leave and free their slot for the next waiting one. Running requests are kept
in the lowest slots (a leaving request's slot takes the highest running one), so that a decode step reads the
cache as a view rather than gathering it. Every sampled token
records `self.version`, the policy version of the weights that produced it. Between two steps the inference loop
may load new weights (`load_update`, which receives the broadcast straight into the parameters; under `[lora]` the
broadcast carries adapters, merged into the weights from the starting ones, inference/lora_merge.py): in-progress
requests keep their KV cache (computed by older weights) unless it is older than `inference.kv_max_age` versions,
in which case `recompute_kv()` re-prefills them under the new weights. It runs in the inference rank's own process,
on its device; tests and machines without vLLM use it.

Multi-turn episodes (inference/turns.py) keep their cache between turns: a finished request that sets
`keep_cache` has its keys and values copied out of its slot (`park`, the slot is free for others while the
environment answers), and the request of the next turn (`continues` naming it) gets them back and prefills only the
tokens after them (the last sampled token and the environment's reply). The kept cache is an in-flight sequence's
cache like any other: an update recomputes it by the same `kv_max_age` rule (the next turn then prefills the whole
history afresh). Kept caches are device memory beside the slot cache, bounded: they hold `max_parked_tokens` tokens
in all at most (by default as many as the slot cache, `max_num_seqs` x `max_len`); parking one more drops the
oldest first, and the episode of a dropped cache prefills its whole history at its next turn.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from pipelinerl_fsdp.inference.engine import Engine, EngineSettings, Request, stale_kv
from pipelinerl_fsdp.inference.kv_cache import KVCache
from pipelinerl_fsdp.inference.lora_merge import AdapterMerge, place_base
from pipelinerl_fsdp.inference.sampling import sample_next
from pipelinerl_fsdp.models import Transformer, load_hf_model, read_model_args
from pipelinerl_fsdp.models.lora import adapted_weight_name, adapter_layout
from pipelinerl_fsdp.transport.weights import WeightReceiver


@dataclass
class _Parked:
    """The cache of a finished turn, waiting for the episode's next turn."""

    ids: list[int]  # the tokens it holds (the request's prompt and sampled tokens but the last)
    k: torch.Tensor
    v: torch.Tensor
    kv_version: int


class ReferenceEngine(Engine):
    @classmethod
    def open(cls, settings: EngineSettings) -> ReferenceEngine:
        s, inf = settings, settings.inference
        model = load_hf_model(s.model_path, s.device, s.dtype)
        return cls(model, inf.max_num_seqs, s.max_len, s.stop_token_ids, inf.temperature, inf.top_p, s.seed)

    @classmethod
    def create(cls, settings: EngineSettings) -> tuple[ReferenceEngine, WeightReceiver]:
        s = settings
        assert s.world is not None
        engine = cls.open(s)
        params = engine.params
        if s.lora is not None:  # the pushes carry adapters (fp32), merged into the weights at each load
            layout = adapter_layout(read_model_args(s.model_path), s.lora)
            receiver = WeightReceiver(
                layout, s.world.weight_group, s.weight_src, torch.float32, s.device, s.bucket_bytes
            )
            engine.merge_adapters([n for n, _ in layout], s.lora.scaling, s.lora.engine_base)
            return engine, receiver
        receiver = WeightReceiver(
            [(n, p.shape) for n, p in params.items()],
            s.world.weight_group,
            s.weight_src,
            s.dtype,
            s.device,
            s.bucket_bytes,
        )
        receiver.bind(params)  # updates land straight in the engine's weights
        return engine, receiver

    def __init__(
        self,
        model: Transformer,
        max_num_seqs: int,
        max_len: int,
        eos_ids: list[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        max_parked_tokens: int | None = None,
    ) -> None:
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache = KVCache(model.args, max_num_seqs, max_len, self.device, self.dtype)
        self.max_len = max_len
        self.eos = set(eos_ids)
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.generated_tokens, self.busy_s, self.seq_s = 0, 0.0, 0.0
        self.prefill_tokens = 0  # tokens run through a prefill or an extension (a kept cache saves them)
        self.parked: dict[int, _Parked] = {}  # request id -> its kept cache (`Request.keep_cache`), oldest first
        self.max_parked_tokens = max_num_seqs * max_len if max_parked_tokens is None else max_parked_tokens
        self.parked_dropped = 0  # kept caches dropped to stay within max_parked_tokens
        self._staging: dict[str, torch.Tensor] | None = None  # async mode: a received, not yet loaded update
        self._merge: AdapterMerge | None = None  # `[lora]`: updates carry adapters (`merge_adapters`)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def merge_adapters(self, adapter_names: list[str], scaling: float, engine_base: str = "device") -> None:
        """From now on updates carry these adapter factors (`[lora]`): keep W0, the current weights of the linears
        they adapt (where `engine_base` says: `lora_merge.base_placement`), and load each update as
        W0 + scaling B A (inference/lora_merge.py)."""
        params = self.params
        names = [adapted_weight_name(n) for n in adapter_names if ".lora_A." in n]
        base = place_base({n: params[n].detach().clone() for n in names}, engine_base, self.device)
        self._merge = AdapterMerge(base, scaling, adapter_names)

    def add(self, request: Request) -> None:
        if len(request.prompt_ids) + request.max_tokens > self.max_len:
            raise ValueError(
                f"request {request.request_id}: prompt ({len(request.prompt_ids)}) + max_tokens "
                f"({request.max_tokens}) exceeds the engine's max_len {self.max_len}"
            )
        self.waiting.append(request)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def stats(self) -> tuple[int, float, float]:
        """Busy time = time spent inside `step()`; each step's sequences count for its duration."""
        return self.generated_tokens, self.busy_s, self.seq_s

    @torch.no_grad()
    def _prefill(self, reqs: list[Request], upto_last: bool) -> torch.Tensor:
        """Fill the slots of `reqs` under the current weights; returns the logits after each sequence.

        upto_last=False: the prompt of a new request. True (recompute): prompt + generated tokens except the
        last one, which the next decode step feeds as usual.
        """
        seqs = [r.prompt_ids + (r.tokens[:-1] if upto_last else []) for r in reqs]
        slots, pos = self.cache.begin_prefill([r.slot for r in reqs], [len(s) for s in seqs])
        ids = torch.tensor([t for s in seqs for t in s], device=self.device)[None]
        logits = self.model(ids, pos, cache=self.cache)[0]
        self.cache.end_prefill()
        self.prefill_tokens += ids.shape[1]
        for r in reqs:
            r.kv_version = self.version
        last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
        return logits[last]

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One engine step: every running request feeds its last token and samples the next; waiting requests
        are admitted into free slots (prefill) and sample their first token. All logits of a step come from
        the current weights, so each new token carries `self.version`. Returns the requests that finished."""
        t0 = time.perf_counter()
        batches: list[tuple[list[Request], torch.Tensor]] = []
        if self.running:
            reqs = [self.running[s] for s in sorted(self.running)]
            slots = torch.tensor([r.slot for r in reqs], device=self.device)
            pos = self.cache.begin_decode(slots)
            ids = torch.tensor([[r.tokens[-1]] for r in reqs], device=self.device)
            logits = self.model(ids, pos, cache=self.cache)[:, 0]
            self.cache.end_decode()
            batches.append((reqs, logits))
        new = []
        while self.waiting and self.free_slots:
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.running[r.slot] = r
            new.append(r)
        resumed = [(r, p) for r in new if (p := self._kept_cache(r)) is not None]
        continuing = {r.request_id for r, _ in resumed}
        fresh = [r for r in new if r.request_id not in continuing]
        if resumed:
            batches.append(([r for r, _ in resumed], self._extend(resumed)))
        if fresh:
            batches.append((fresh, self._prefill(fresh, upto_last=False)))
        if not batches:
            return []
        reqs = [r for b, _ in batches for r in b]
        tok, lp = self._sample(reqs, torch.cat([logits for _, logits in batches]))
        done = []
        for r, t, logprob in zip(reqs, tok.tolist(), lp.tolist()):
            r.tokens.append(t)
            r.logprobs.append(logprob)
            r.versions.append(self.version)
            if t in self.eos or len(r.tokens) >= r.max_tokens:
                r.finished = t in self.eos
                done.append(r)
        for r in done:
            if r.keep_cache:
                k, v = self.cache.park(r.slot)
                self._park(r.request_id, _Parked(r.prompt_ids + r.tokens[:-1], k, v, r.kv_version))
            self._release(r)
        self.generated_tokens += len(reqs)
        took = time.perf_counter() - t0
        self.busy_s += took
        self.seq_s += len(reqs) * took
        return done

    def _park(self, request_id: int, parked: _Parked) -> None:
        """Keep `parked`, dropping the oldest kept caches while they hold more than `max_parked_tokens` tokens."""
        self.parked[request_id] = parked
        held = sum(len(p.ids) for p in self.parked.values())
        while held > self.max_parked_tokens:
            held -= len(self.parked.pop(next(iter(self.parked))).ids)
            self.parked_dropped += 1

    def _kept_cache(self, r: Request) -> _Parked | None:
        """The parked cache `r` continues, when there is one and it holds a prefix of r's prompt."""
        p = self.parked.pop(r.continues, None) if r.continues is not None else None
        if p is None or len(p.ids) >= len(r.prompt_ids) or r.prompt_ids[: len(p.ids)] != p.ids:
            return None
        return p

    @torch.no_grad()
    def _extend(self, resumed: list[tuple[Request, _Parked]]) -> torch.Tensor:
        """Put each kept cache back into its request's slot and run the prompt's tokens after it (one forward per
        request: their lengths differ); returns the logits after each."""
        out = []
        for r, p in resumed:
            self.cache.restore(r.slot, p.k, p.v)
            new = r.prompt_ids[len(p.ids) :]
            pos = self.cache.begin_extend(r.slot, len(new))
            logits = self.model(torch.tensor([new], device=self.device), pos, cache=self.cache)[0, -1]
            self.cache.end_decode()
            self.prefill_tokens += len(new)
            r.kv_version = p.kv_version  # its oldest entry is still the parked one's
            out.append(logits)
        return torch.stack(out)

    def forget(self, request_id: int) -> None:
        self.parked.pop(request_id, None)

    def _release(self, r: Request) -> None:
        """Free `r`'s slot, moving the highest running request into it: running requests stay in slots 0..n-1, and
        `free_slots` (popped from the end) hands out the lowest free slot."""
        del self.running[r.slot]
        last = max(self.running, default=-1)
        freed = r.slot
        if last > r.slot:
            moved = self.running.pop(last)
            self.cache.move(last, r.slot)
            moved.slot, self.running[r.slot] = r.slot, moved
            freed = last
        else:
            self.cache.free(freed)
        self.free_slots.append(freed)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample every row with its request's settings (the engine's unless the request sets its own)."""
        settings = [
            (self.temperature if r.temperature is None else r.temperature, self.top_p if r.top_p is None else r.top_p)
            for r in reqs
        ]
        if len(set(settings)) == 1:
            return sample_next(logits, *settings[0], self.generator)
        tok = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
        lp = torch.empty(len(reqs), dtype=torch.float32, device=logits.device)
        for setting in dict.fromkeys(settings):
            rows = torch.tensor([i for i, s in enumerate(settings) if s == setting], device=logits.device)
            tok[rows], lp[rows] = sample_next(logits[rows], *setting, self.generator)
        return tok, lp

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the weights (the job's weight receiver writes in place instead)."""
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under both names
        for name, t in named:
            params[name].copy_(t)

    def set_version(self, version: int) -> None:
        """Call after loading new weights into `self.params`; later tokens carry this version."""
        self.version = version

    def load_update(self, receiver: WeightReceiver, version: int, kv_max_age: int) -> int:
        if self._merge is not None:
            merge = self._merge
            receiver.receive_buckets(load=lambda views: self.load_weights(list(merge(views))))
        else:
            receiver.receive_buckets()  # into the bound parameters: the weights change in place
        self.set_version(version)
        running = list(self.running.values())
        stale = [r for r, s in zip(running, stale_kv([r.kv_version for r in running], version, kv_max_age)) if s]
        if stale:
            self.recompute_kv(stale)
        # kept caches of episodes between turns: a stale one is dropped, and the next turn prefills its history
        parked = list(self.parked)
        old = stale_kv([self.parked[i].kv_version for i in parked], version, kv_max_age)
        gone = [i for i, s in zip(parked, old) if s]
        for i in gone:
            del self.parked[i]
        return len(stale) + len(gone)

    def stage_update(self, receiver: WeightReceiver) -> None:
        if self._staging is None and self._merge is not None:  # the adapters, in the stream's layout and dtype
            self._staging = {
                n: torch.empty(shape, dtype=receiver.dtype, device=receiver.device)
                for n, shape in receiver.layout.names_and_shapes
            }
        if self._staging is None:
            self._staging = {n: torch.empty_like(p) for n, p in self.params.items()}
        staging = self._staging

        def keep(views: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in views:
                staging[name].copy_(t)

        receiver.receive_buckets(load=keep, staged=True)

    def apply_staged(self, version: int) -> None:
        assert self._staging is not None, "apply_staged without a staged update"
        staged = list(self._staging.items())  # in the stream's order
        self.load_weights(list(self._merge(staged)) if self._merge is not None else staged)
        self.set_version(version)

    def close(self) -> None:
        """Nothing to stop: the engine lives in this process."""
        self.parked.clear()

    @torch.no_grad()
    def recompute_kv(self, reqs: list[Request] | None = None) -> None:
        """Re-prefill running requests (`reqs`, default all) under the current weights."""
        reqs = list(self.running.values()) if reqs is None else reqs
        for r in reqs:
            self.cache.free(r.slot)
        if reqs:
            self._prefill(reqs, upto_last=True)
