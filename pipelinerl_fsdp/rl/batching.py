"""Batching rules of the RL step (pure): how a step's samples are split over trainer ranks and packed into
micro-batches (`RLMicroBatch`) whose loss fields line up with the next-token targets."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pipelinerl_fsdp.episodes import turn_indices
from pipelinerl_fsdp.rl.loss import LossInput
from pipelinerl_fsdp.rl.packing import PackedRow, nonzero_index, pack_into_bins, pack_row, per_target
from pipelinerl_fsdp.rl.positions import completion_tenths
from pipelinerl_fsdp.samples import ENV_VERSION, Sample


def sample_tokens(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.completion_ids)


def split_balanced(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Split samples over n ranks: equal counts (±1), greedily balancing tokens (longest first)."""
    order = sorted(range(len(samples)), key=lambda i: -sample_tokens(samples[i]))
    parts: list[list[Sample]] = [[] for _ in range(n)]
    tokens = [0] * n
    cap = -(-len(samples) // n)
    for i in order:
        r = min((r for r in range(n) if len(parts[r]) < cap), key=lambda r: tokens[r])
        parts[r].append(samples[i])
        tokens[r] += sample_tokens(samples[i])
    return parts


def after_update_marks(versions: list[int]) -> list[float]:
    """Per completion token, 1.0 where it was sampled after an in-flight update within its sequence (a newer version
    than the sequence's first sampled token's): the tokens whose context's KV cache older weights may have computed,
    unless the engine recomputed it (`inference.kv_max_age`). A multi-turn episode is one sequence: the reference
    engine carries a turn's cache into the next turn, while vLLM prefills each turn's history afresh, which acts
    as a recompute at every turn boundary (inference/turns.py). Environment tokens are never marked."""
    first = next((v for v in versions if v != ENV_VERSION), 0)
    return [float(v != ENV_VERSION and v > first) for v in versions]


def pinned_copies(device: torch.device) -> bool:
    """Whether micro-batches for `device` are built on the host in pinned (page-locked) memory and copied with
    `non_blocking=True`: on CUDA, so that the copy neither waits for the GPU's queue nor blocks the host while
    the GPU still runs the previous micro-batch. On CPU nothing moves."""
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and copied asynchronously where `pinned_copies` says, else `t.to(device)`
    (the same tensor when it is already there). The pinned buffer comes from torch's caching host allocator, which
    keeps it until the copy has run."""
    if pinned_copies(device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def row_to_device(row: PackedRow, device: torch.device) -> PackedRow:
    """A row packed on the host, its tensors (the documents' offsets included) on `device` by `to_device`."""
    docs = row.documents
    if docs is not None and docs.cu_seqlens is not None:
        docs = replace(docs, cu_seqlens=to_device(docs.cu_seqlens, device))
    return PackedRow(
        *(to_device(t, device) for t in (row.input_ids, row.position_ids, row.targets, row.seq_index)),
        documents=docs,
        logprob_index=None if row.logprob_index is None else to_device(row.logprob_index, device),
    )


@dataclass
class RLMicroBatch(PackedRow):
    """A packed micro-batch of the RL step: the row the model runs on and, per target, what the loss reads."""

    loss_input: LossInput

    def logprob_positions(self) -> torch.Tensor | None:
        """The loss reads the completion tokens' log-probs only."""
        return self.loss_input.mask[None]


def rl_micro_batches(
    samples: list[Sample], budget: int, device: torch.device, version: int | None = None
) -> list[RLMicroBatch]:
    """Pack samples (prompt + completion) into micro-batches whose loss fields line up with the targets. `mask` is 1
    on the completion tokens a policy sampled (0 on a multi-turn rollout's environment tokens). With the trained
    `version`, field `current` marks the completion tokens that version sampled (lag 0: where engine and trainer
    log-probs should agree, see `rl.loss.policy_loss`) and `after_update` those sampled after an in-flight update
    within their sequence (`after_update_marks`), and `position` is each completion token's index in its completion
    (-1 on prompt targets), for the mismatch per position, `tenth` its relative position (`rl.positions.
    completion_tenths`: 1..10; 0 on prompt targets and environment tokens), for the ESS and |log ratio| per tenth,
    `turn` the index of its model turn (from 1; 0 on prompt targets and environment tokens), for the ESS per turn,
    and `lag` the versions between `version` and the one that sampled it (0 on prompt targets and environment
    tokens), for `loss.max_token_lag`. Field `weight` is each token's sample's loss weight (`Sample.loss_weight`,
    rl/normalization.py)."""
    seqs: list[list[int]] = []
    per_token: dict[str, list[list[float]]] = {"mask": [], "behaviour_logp": [], "advantage": [], "weight": []}
    if version is not None:
        per_token.update(current=[], after_update=[], position=[], tenth=[], turn=[], lag=[])
    for s in samples:
        seqs.append(s.prompt_ids + s.completion_ids)
        n_prompt_targets = len(s.prompt_ids) - 1
        n = len(s.completion_ids)
        # the tokens a policy sampled; environment tokens (multi-turn) are context only
        per_token["mask"].append([0.0] * n_prompt_targets + [float(v != ENV_VERSION) for v in s.versions])
        per_token["behaviour_logp"].append([0.0] * n_prompt_targets + list(s.logprobs))
        per_token["advantage"].append([0.0] * n_prompt_targets + [s.advantage] * n)
        per_token["weight"].append([0.0] * n_prompt_targets + [s.loss_weight] * n)
        if version is not None:
            per_token["current"].append([0.0] * n_prompt_targets + [float(v == version) for v in s.versions])
            per_token["after_update"].append([0.0] * n_prompt_targets + after_update_marks(s.versions))
            per_token["position"].append([-1.0] * n_prompt_targets + [float(i) for i in range(n)])
            per_token["tenth"].append([0.0] * n_prompt_targets + [float(i) for i in completion_tenths(s.versions)])
            per_token["turn"].append([0.0] * n_prompt_targets + [float(i) for i in turn_indices(s.versions)])
            lags = [float(version - v) if v != ENV_VERSION else 0.0 for v in s.versions]
            per_token["lag"].append([0.0] * n_prompt_targets + lags)
    out = []
    host = torch.device("cpu")
    for b in pack_into_bins([len(s) for s in seqs], budget):
        row_seqs = [seqs[i] for i in b]
        row = row_to_device(pack_row(row_seqs, host), device)
        # the loss's tokens, as indices built on the host
        row.logprob_index = to_device(nonzero_index([m for i in b for m in per_token["mask"][i]], host), device)
        fields = {k: to_device(per_target(row_seqs, [v[i] for i in b], k, host), device) for k, v in per_token.items()}
        out.append(RLMicroBatch(**vars(row), loss_input=LossInput(**fields, seq=row.seq_index[0], n_seq=len(b))))
    return out
