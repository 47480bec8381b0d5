"""The generation-engine interface every inference rank drives, whatever runs underneath (vLLM, the reference).

An engine takes requests, advances them (`step`), and between two steps takes a weight update whose header the
inference loop has just received, with exact per-token versions: every token records the policy version of the
weights that produced it. The inference loop (`inference/worker.py`) only talks to this interface; the factory
(`inference/factory.py`) is the one place that knows which engines exist.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipelinerl_fsdp.config import InferenceConfig, LoRAConfig
    from pipelinerl_fsdp.episodes import Episode
    from pipelinerl_fsdp.job.world import World
    from pipelinerl_fsdp.transport.weights import WeightReceiver


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # ended on a stop token (False: cut at max_tokens)
    slot: int = -1
    # sampling settings of this request (evaluation); None: the engine's (the training rollouts')
    temperature: float | None = None
    top_p: float | None = None
    # the policy version whose weights computed the oldest entry of this request's KV cache; -1: no cache yet
    kv_version: int = -1
    # multi-turn (inference/turns.py): the episode whose turns this request runs; once it has ended, the text of the
    # whole transcript (model and environment turns) and the number of model turns
    episode: Episode | None = None
    transcript: str | None = None
    turns: int = 1
    # multi-turn, between an episode's turns: keep this request's KV cache once it finishes, for the request that
    # `continues` it (an engine that cannot keep it ignores both and prefills the next turn's whole prompt)
    keep_cache: bool = False
    continues: int | None = None


@dataclass
class EngineSettings:
    """What the factory resolves from the config and the world, the same for every engine kind."""

    inference: InferenceConfig  # the engine kind's own section class
    timeout_s: float  # world.timeout_s: a start-up or a collective stuck longer fails
    debug: bool  # job.debug: the engine's own logs
    threads_per_rank: int  # job.threads_per_rank
    # None: an engine outside a job (`factory.generation_engine`): it only generates, on `cores` or GPU 0
    world: World | None
    model_path: str
    tokenizer_path: str
    # longest prompt + max_new_tokens: the engine's context length
    max_len: int
    # the ids that end a completion (tokenizer EOS + the model's generation_config eos ids), the same everywhere
    stop_token_ids: list[int]
    # weights of the engine and of the broadcast; where an engine in this process runs
    dtype: torch.dtype
    device: torch.device
    seed: int
    bucket_bytes: int
    # members of the group the engine's workers join to receive the buckets (engines in processes of their own)
    bucket_group_size: int
    # outside a job, on CPU: the cores of an engine in its own processes (vLLM's OpenMP threads; None: its choice)
    cores: str | None = None
    # pushes carry these adapters (fp32), which the engine merges into the base weights it started with; None:
    # pushes carry the full weights in `dtype`
    lora: LoRAConfig | None = None

    @property
    def weight_src(self) -> int:
        assert self.world is not None, "an engine outside a job receives no weights"
        return self.world.trainer_ranks[0]


def stale_kv(kv_versions: list[int], version: int, max_age: int) -> list[bool]:
    """Which KV caches to recompute when the weights of `version` load: those whose oldest entry was computed by a
    version more than `max_age` behind it (`inference.kv_max_age`; -1: none, the cache is always kept; 0: every
    cache there is). `kv_versions`: per sequence, the version of its oldest cached entry (-1: no cache)."""
    if max_age < 0:
        return [False] * len(kv_versions)
    return [kv >= 0 and version - kv > max_age for kv in kv_versions]


class Engine(ABC):
    """A continuous-batching generation engine with in-flight weight updates.

    Update protocol, driven by the inference loop between two `step()` calls, after the header of an update has
    arrived on the job's `WeightReceiver`:
      pipeline / conventional: `load_update` pauses generation, receives the buckets, loads them and resumes;
        sequences in flight continue under the new weights (their KV cache kept, or recomputed once older than
        `inference.kv_max_age` versions: `stale_kv`);
      async: `stage_update` receives the buckets without loading them, and `apply_staged` loads them once the
        engine has drained (one version per sequence).
    """

    version: int = 0

    @classmethod
    @abstractmethod
    def create(cls, settings: EngineSettings) -> tuple[Engine, WeightReceiver]:
        """Start the engine and the receiver of weight-update headers (and, for engines in this process, of the
        buckets). Collective with the first trainer rank where the engine's workers join a bucket group."""

    @classmethod
    def open(cls, settings: EngineSettings) -> Engine:
        """Start the engine alone, on the weights at `settings.model_path`, with no receiver of updates (`create`
        adds it). Kinds the factory builds implement it; a wrapper of another engine does not."""
        raise NotImplementedError(f"{cls.__name__} is not built from settings")

    @abstractmethod
    def add(self, request: Request) -> None:
        """Submit a request; it starts when the engine has room."""

    @abstractmethod
    def step(self) -> list[Request]:
        """Advance generation; returns the requests that finished since the last call (tokens, log-probs, versions
        filled in). Raises if the engine has failed."""

    @abstractmethod
    def num_unfinished(self) -> int:
        """Requests submitted and not yet returned by `step`."""

    @abstractmethod
    def stats(self) -> tuple[int, float, float]:
        """(completion tokens generated, seconds busy, sequence-seconds) so far: busy = at least one request in
        flight, less the update pauses; sequence-seconds = the number of sequences in flight integrated over the
        busy time, so that their delta over a busy delta is the mean batch the engine ran (its occupancy once
        divided by `inference.max_num_seqs`). Read all at once: the loop turns their deltas into rates and
        fractions."""

    @abstractmethod
    def load_update(self, receiver: WeightReceiver, version: int, kv_max_age: int) -> int:
        """Take the update whose header just arrived: later tokens carry `version`. Sequences in flight whose KV
        cache is stale by `stale_kv(..., kv_max_age)` are prefilled again under the new weights; returns how many
        sequences were (an engine that can only recompute all at once recomputes all when any is stale)."""

    @abstractmethod
    def stage_update(self, receiver: WeightReceiver) -> None:
        """Receive the update whose header just arrived without loading it; generation goes on unchanged."""

    @abstractmethod
    def apply_staged(self, version: int) -> None:
        """Load the staged update (call when no request is in flight); later tokens carry `version`."""

    @abstractmethod
    def close(self) -> None:
        """Stop the engine (and any process it started); unfinished requests are dropped."""

    def forget(self, request_id: int) -> None:
        """Drop the cache a finished request kept (`Request.keep_cache`) when no request will continue it (an
        engine that keeps none has nothing to drop)."""
        return None
