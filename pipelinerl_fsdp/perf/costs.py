"""The cost models of the job's three activities, as small frozen dataclasses with pure methods: an engine's decode
step (`DecodeCost`), a trainer step (`TrainCost`) and a weight push (`PushCost`). Where their coefficients come
from is elsewhere: a hardware spec and the model's shape (`perf/spec.py`) or a measured profile (`perf/profile.py`).

Every time is in seconds, every size in tokens or bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check(name: str, values: dict[str, float]) -> None:
    bad = [
        f"{k} = {v!r}" for k, v in values.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)
    ]
    if bad:
        raise ValueError(f"{name}: {', '.join(bad)} (each must be a finite number >= 0)")


@dataclass(frozen=True)
class DecodeCost:
    """One engine decode step over `n` live sequences whose contexts sum to `kv` tokens (DistServe's form):

        base_s + per_seq_s * n + per_kv_s * kv   (+ prefill_per_token_s * the prompt tokens admitted into this step)

    base_s: reading the weights once plus the scheduler's fixed per-step overhead; per_seq_s: each sequence's
    matrix products and sampling; per_kv_s: reading one token's KV cache; prefill_per_token_s: a prompt's prefill,
    added to the step that admits it (prefill/decode interference: the running sequences wait for it).
    A live sequence's context is its prompt plus the tokens it has generated before the step, so between two
    events (nothing admitted, nothing finished) the summed context grows by n each step."""

    base_s: float
    per_seq_s: float
    per_kv_s: float = 0.0
    prefill_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        _check("DecodeCost", vars(self))
        if self.base_s + self.per_seq_s <= 0:
            raise ValueError("DecodeCost: base_s + per_seq_s must be > 0 (a step that takes no time never ends)")

    def step_s(self, live: int, kv_sum: float, prefill_tokens: float = 0.0) -> float:
        """One step with `live` sequences of summed context `kv_sum`, admitting prompts of `prefill_tokens`."""
        return self.base_s + self.per_seq_s * live + self.per_kv_s * kv_sum + self.prefill_per_token_s * prefill_tokens

    def steps_s(self, k: int, live: int, kv_start: float, prefill_tokens: float = 0.0) -> float:
        """k consecutive steps with `live` sequences whose summed context is `kv_start` at the first step and grows
        by `live` each step; the prefill of `prefill_tokens` is in the first step. Closed form of the sum:
        k (base + per_seq n + per_kv c) + per_kv n k (k - 1) / 2 (+ prefill if k >= 1)."""
        if k <= 0:
            return 0.0
        first = self.base_s + self.per_seq_s * live + self.per_kv_s * kv_start
        return k * first + self.per_kv_s * live * k * (k - 1) / 2 + self.prefill_per_token_s * prefill_tokens

    def steps_within(self, dt: float, live: int, kv_start: float, prefill_tokens: float = 0.0) -> int:
        """The fewest steps (from the same state as `steps_s`) that end at or after `dt` seconds: the step boundary
        at which something arriving `dt` after the first step began is taken (0 when dt <= 0)."""
        if dt <= 0:
            return 0
        a = self.per_kv_s * live / 2  # steps_s(k) = a k^2 + (first - a) k + prefill, for k >= 1
        b = self.base_s + self.per_seq_s * live + self.per_kv_s * kv_start - a
        c = self.prefill_per_token_s * prefill_tokens - dt
        if a > 0:
            k = (-b + math.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a)
        else:
            k = -c / b
        k = max(1, math.ceil(k - 1e-9))
        while k > 1 and self.steps_s(k - 1, live, kv_start, prefill_tokens) >= dt:  # rounding, both ways
            k -= 1
        while self.steps_s(k, live, kv_start, prefill_tokens) < dt:
            k += 1
        return k


@dataclass(frozen=True)
class TrainCost:
    """One optimizer step of the trainer ranks together (`ranks` of them, data parallel, FSDP2):

        step_base_s + per_token_s * tokens + per_micro_batch_s * micro_batches + per_token_ctx_s * sum(len^2) / 2

    tokens: the batch's tokens (prompt + completion of every sample); micro_batches: per rank (the ranks run in
    lockstep); sum(len^2) / 2: the causal attention's token pairs, one term per packed sequence (0 unless
    calibrated: the matrix products dominate at the lengths RL trains on). per_token_s is already divided over
    the ranks. step_base_s is what runs once per step after the last backward: gradient reduction, the optimizer,
    the fixed overhead. With `rl.waves` each part's forward/backward costs `part_s` and step_base_s comes once."""

    step_base_s: float
    per_token_s: float
    per_micro_batch_s: float = 0.0
    per_token_ctx_s: float = 0.0
    ranks: int = 1
    micro_batch_tokens: int = 4096

    def __post_init__(self) -> None:
        _check("TrainCost", vars(self))
        if self.ranks < 1 or self.micro_batch_tokens < 1:
            raise ValueError(f"TrainCost: ranks ({self.ranks}) and micro_batch_tokens ({self.micro_batch_tokens}) >= 1")

    def step_s(self, tokens: float, micro_batches: float, sq_sum: float = 0.0) -> float:
        """A whole step on `tokens` tokens in `micro_batches` micro-batches per rank; `sq_sum`: sum of the packed
        sequences' squared lengths."""
        return self.step_base_s + self.part_s_of(tokens, micro_batches, sq_sum)

    def part_s_of(self, tokens: float, micro_batches: float, sq_sum: float = 0.0) -> float:
        """Forward/backward only (no step_base_s)."""
        return self.per_token_s * tokens + self.per_micro_batch_s * micro_batches + self.per_token_ctx_s * sq_sum / 2

    def micro_batches(self, tokens: float) -> int:
        """Micro-batches per rank for `tokens` balanced over the ranks, packed under micro_batch_tokens (packing
        loss ignored: whole sequences leave a little room in each)."""
        return math.ceil(tokens / self.ranks / self.micro_batch_tokens) if tokens > 0 else 0

    def part_s(self, lengths: list[int] | tuple[int, ...]) -> float:
        """Forward/backward on sequences of these lengths (prompt + completion each)."""
        tokens = float(sum(lengths))
        return self.part_s_of(tokens, self.micro_batches(tokens), float(sum(n * n for n in lengths)))

    def batch_s(self, lengths: list[int] | tuple[int, ...]) -> float:
        """A whole step on sequences of these lengths, in one part."""
        return self.step_base_s + self.part_s(lengths)


@dataclass(frozen=True)
class PushCost:
    """A weight update of `bytes` (in the engines' dtype), in buckets of `bucket_bytes`.

    Trainer side: each bucket is all-gathered over the trainer ranks (`gather_bytes_per_s`; 0: no gather, one
    trainer) and broadcast to the engines (`link_bytes_per_s`, plus `per_bucket_s` of latency per bucket); the
    broadcast of one bucket overlaps the gather of the next (two send buffers), a two-stage pipeline:
    transfer = g + b + (n - 1) max(g, b) with g and b one bucket's gather and broadcast.
    Engine side: the engine receives the whole transfer, then loads: load_base_s + load_per_byte_s * bytes
    (weights repacked or copied into place, the scheduler paused and resumed)."""

    bytes: float
    bucket_bytes: float
    link_bytes_per_s: float
    gather_bytes_per_s: float = 0.0
    per_bucket_s: float = 0.0
    load_base_s: float = 0.0
    load_per_byte_s: float = 0.0

    def __post_init__(self) -> None:
        _check("PushCost", vars(self))
        if self.bucket_bytes <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("PushCost: bucket_bytes and link_bytes_per_s must be > 0")

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.bytes / self.bucket_bytes))

    def transfer_s(self) -> float:
        """From the push's start (every engine listening) to the last bucket received."""
        n = self.buckets
        size = self.bytes / n
        g = size / self.gather_bytes_per_s if self.gather_bytes_per_s > 0 else 0.0
        b = size / self.link_bytes_per_s + self.per_bucket_s
        return g + b + (n - 1) * max(g, b)

    def load_s(self) -> float:
        """The engine's load once the bytes are in (and, in async mode, the whole apply of a staged update)."""
        return self.load_base_s + self.load_per_byte_s * self.bytes

    def trainer_s(self) -> float:
        """The trainer's time on a push it waits for (`rl.overlap_push = false`), every engine listening."""
        return self.transfer_s()

    def pause_s(self) -> float:
        """An engine's pause for an update it takes at once (pipeline, conventional), every engine listening."""
        return self.transfer_s() + self.load_s()
