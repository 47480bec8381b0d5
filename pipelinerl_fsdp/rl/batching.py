"""Batching rules of the RL step (pure): how a step's samples are split over trainer ranks and packed into
micro-batches (`RLMicroBatch`) whose loss fields line up with the next-token targets."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from pipelinerl_fsdp.models.documents import Documents
from pipelinerl_fsdp.rl.loss import LossInput
from pipelinerl_fsdp.rl.packing import PackedRow, pack_into_bins
from pipelinerl_fsdp.rl.positions import TENTHS
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


def segment_cumsum(x: torch.Tensor, segment: torch.Tensor, n_segments: int) -> torch.Tensor:
    """Inclusive cumulative sum of `x` within each segment of a flat tensor: `segment[i]` (0..n_segments - 1,
    non-decreasing) is the segment of `x[i]`, e.g. the sample a completion token belongs to."""
    totals = torch.zeros(n_segments, dtype=x.dtype).index_add_(0, segment, x)
    return x.cumsum(0) - (totals.cumsum(0) - totals)[segment]


def completion_fields(versions: torch.Tensor, sample: torch.Tensor, n_samples: int, version: int) -> dict:
    """Per completion token of a batch, flat (sample after sample: `versions` [C] the `Sample.versions`
    concatenated, `sample` [C] the index of each token's sample), what the loss reads besides the mask, float32:
    `current` 1 where the trained `version` sampled it; `after_update` 1 where it was sampled after an in-flight
    update within its sequence, i.e. by a newer version than the sequence's first sampled token's (the tokens whose
    context's KV cache older weights may have computed, unless the engine recomputed it: `inference.kv_max_age`; a
    multi-turn episode is one sequence: the reference engine carries a turn's cache into the next turn, while vLLM
    prefills each turn's history afresh, which acts as a recompute at every turn boundary, inference/turns.py);
    `position` its index in its completion; `tenth` its tenth among its completion's model tokens
    (`rl.positions.tenth`: 1..10); `turn` the index (from 1) of its model turn, a maximal run of model tokens
    (`episodes.turn_spans`); `lag` the versions between `version` and the one that sampled it. Environment tokens
    (`ENV_VERSION`, multi-turn) get 0 in every field but `position`."""
    model = versions != ENV_VERSION
    m = model.long()
    before = segment_cumsum(m, sample, n_samples) - m  # model tokens before this one in its completion
    n_model = torch.zeros(n_samples, dtype=torch.long).index_add_(0, sample, m)
    tenth = torch.div(TENTHS * before, n_model.clamp(min=1)[sample], rounding_mode="floor") + 1
    first = torch.zeros(n_samples, dtype=torch.long)  # the version of each sequence's first sampled token
    is_first = model & (before == 0)
    first[sample[is_first]] = versions[is_first]
    starts = model.clone()  # a model turn starts at a model token after an environment token or the start
    starts[1:] &= ~model[:-1] | (sample[1:] != sample[:-1])
    zero = torch.zeros((), dtype=torch.long)
    out = {
        "current": versions == version,
        "after_update": model & (versions > first[sample]),
        "position": segment_cumsum(torch.ones_like(sample), sample, n_samples) - 1,
        "tenth": torch.where(model, tenth, zero),
        "turn": torch.where(model, segment_cumsum(starts.long(), sample, n_samples), zero),
        "lag": torch.where(model, version - versions, zero),
    }
    return {k: v.float() for k, v in out.items()}


def flat(lists: Iterable[Iterable[float]], dtype: type) -> torch.Tensor:
    """The lists' values concatenated in one host tensor of the numpy `dtype` (numpy reads Python numbers 3-7x
    faster than `torch.tensor`)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(lists), dtype=dtype))


def _check_sample(i: int, s: Sample) -> None:
    if len(s.prompt_ids) < 1 or not len(s.versions) == len(s.logprobs) == len(s.completion_ids):
        raise ValueError(
            f"sample {i}: {len(s.prompt_ids)} prompt tokens (at least 1), {len(s.completion_ids)} completion tokens "
            f"with {len(s.logprobs)} log-probs and {len(s.versions)} versions (one each)"
        )
    if len(s.prompt_ids) + len(s.completion_ids) < 2:
        raise ValueError(f"sample {i} has {sample_tokens(s)} token(s); training needs at least 2")


def rl_micro_batches(
    samples: list[Sample], budget: int, device: torch.device, version: int | None = None
) -> list[RLMicroBatch]:
    """Pack samples (prompt + completion) into micro-batches (`pack_into_bins`: whole sequences under `budget`
    tokens, each row as `pack_row` packs it) whose loss fields line up with the targets. `mask` is 1 on the
    completion tokens a policy sampled (0 on a multi-turn rollout's environment tokens), `behaviour_logp` their
    log-probs, `advantage` and `weight` their sample's advantage and loss weight (`Sample.loss_weight`,
    rl/normalization.py). With the trained `version`, the fields of `completion_fields` too (`current` marks where
    engine and trainer log-probs should agree, see `rl.loss.policy_loss`; `position` is -1 on prompt targets, the
    others 0). Built on the host from one tensor per list of the samples and vector operations (a Python loop over
    tokens took 0.17 s for 129k tokens: time the GPU waits), then moved by `row_to_device`/`to_device`."""
    for i, s in enumerate(samples):
        _check_sample(i, s)
    bins = pack_into_bins([sample_tokens(s) for s in samples], budget)
    ordered = [samples[i] for b in bins for i in b]  # every bin a contiguous run of samples, so of targets
    n = len(ordered)
    if n == 0:
        return []
    prompt = torch.tensor([len(s.prompt_ids) for s in ordered])
    completion = torch.tensor([len(s.completion_ids) for s in ordered])
    n_targets = prompt + completion - 1
    tokens = flat((chain(s.prompt_ids, s.completion_ids) for s in ordered), np.int64)
    ends = (prompt + completion).cumsum(0)
    is_input, is_target = torch.ones(len(tokens), dtype=torch.bool), torch.ones(len(tokens), dtype=torch.bool)
    is_input[ends - 1] = False  # a sequence's last token is no input, its first no target
    is_target[ends - prompt - completion] = False
    target_sample = torch.repeat_interleave(torch.arange(n), n_targets)
    positions = segment_cumsum(torch.ones_like(target_sample), target_sample, n) - 1
    target_start = n_targets.cumsum(0) - n_targets
    token_sample = torch.repeat_interleave(torch.arange(n), completion)
    versions = flat((s.versions for s in ordered), np.int64)
    per_token = {
        "mask": (versions != ENV_VERSION).float(),
        "behaviour_logp": flat((s.logprobs for s in ordered), np.float32),
        "advantage": torch.tensor([s.advantage for s in ordered], dtype=torch.float32)[token_sample],
        "weight": torch.tensor([s.loss_weight for s in ordered], dtype=torch.float32)[token_sample],
    }
    if version is not None:
        per_token.update(completion_fields(versions, token_sample, n, version))
    # the completion tokens' places among the targets: after their sample's prompt targets
    in_completion = segment_cumsum(torch.ones_like(token_sample), token_sample, n) - 1
    place = target_start[token_sample] + (prompt - 1)[token_sample] + in_completion
    fields = {
        name: torch.full((len(positions),), -1.0 if name == "position" else 0.0).index_put_((place,), v)
        for name, v in per_token.items()
    }
    row_tensors = (tokens[is_input], positions, tokens[is_target], target_sample)
    bounds = [0, *n_targets.cumsum(0).tolist()]  # sample i's targets: bounds[i]:bounds[i + 1]
    out, first, host = [], 0, torch.device("cpu")
    for b in bins:
        lo, hi = bounds[first], bounds[first + len(b)]
        ids, pos, tgt, seq = (t[lo:hi][None] for t in row_tensors)
        docs = Documents.from_lengths([n_targets[first : first + len(b)].tolist()], host)
        row = row_to_device(PackedRow(ids, pos, tgt, seq - first, documents=docs), device)
        mask = fields["mask"][lo:hi]
        row.logprob_index = to_device(mask.nonzero()[:, 0], device)
        loss_fields = {k: to_device(v[lo:hi], device) for k, v in fields.items()}
        out.append(RLMicroBatch(**vars(row), loss_input=LossInput(**loss_fields, seq=row.seq_index[0], n_seq=len(b))))
        first += len(b)
    return out
