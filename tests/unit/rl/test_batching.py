"""Batching rules: the split over trainer ranks and the packed micro-batches of the RL step."""

from __future__ import annotations

import random

import pytest
import torch

from pipelinerl_fsdp.models.documents import Documents
from pipelinerl_fsdp.rl.batching import rl_micro_batches, sample_tokens, split_balanced
from pipelinerl_fsdp.samples import ENV_VERSION, Sample


def sample(n_prompt: int, n_comp: int, adv: float = 0.5, gid: int = 0) -> Sample:
    return Sample(
        gid, list(range(1, n_prompt + 1)), list(range(10, 10 + n_comp)), [-0.5] * n_comp, [0] * n_comp, 1.0, adv
    )


def test_split_balanced_counts_and_tokens():
    rng = random.Random(0)
    samples = [sample(rng.randint(2, 6), rng.randint(1, 60), gid=i) for i in range(13)]
    parts = split_balanced(samples, 3)
    assert sorted(len(p) for p in parts) == [4, 4, 5]
    assert sorted(id(s) for p in parts for s in p) == sorted(id(s) for s in samples)  # each sample once
    loads = [sum(sample_tokens(s) for s in p) for p in parts]
    # greedy longest-first: no rank exceeds another by more than the longest sample
    assert max(loads) - min(loads) <= max(sample_tokens(s) for s in samples)


def test_split_balanced_separates_two_long_samples():
    samples = [sample(2, 100), sample(2, 100), sample(2, 1), sample(2, 1)]
    parts = split_balanced(samples, 2)
    assert [sum(sample_tokens(s) for s in p) for p in parts] == [105, 105]


def test_split_more_ranks_than_samples_leaves_some_empty():
    parts = split_balanced([sample(2, 3)], 2)
    assert sorted(len(p) for p in parts) == [0, 1]


def test_micro_batches_align_fields_with_targets():
    s1, s2 = sample(3, 2, adv=1.5), sample(2, 3, adv=-0.5)
    (mb,) = rl_micro_batches([s1, s2], budget=64, device=torch.device("cpu"))
    # targets: s1 has 4 (2 prompt targets, then 2 completion tokens), s2 has 4 (1 prompt target, 3 completion)
    assert mb.loss_input.mask.tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert mb.loss_input.advantage.tolist() == [0, 0, 1.5, 1.5, 0, -0.5, -0.5, -0.5]
    assert mb.loss_input.behaviour_logp.tolist() == [0, 0, -0.5, -0.5, 0, -0.5, -0.5, -0.5]
    assert mb.targets[0].tolist() == [2, 3, 10, 11, 2, 10, 11, 12]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mb.loss_input.seq.tolist() == mb.seq_index[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mb.logprob_positions().tolist() == [mb.loss_input.mask.tolist()]  # the model's log-probs: there only


def test_micro_batches_respect_the_budget():
    samples = [sample(4, 10) for _ in range(10)]  # 14 tokens each
    mbs = rl_micro_batches(samples, budget=30, device=torch.device("cpu"))
    assert len(mbs) == 5 and all(mb.input_ids.shape[1] + 2 <= 30 for mb in mbs)


def test_micro_batches_mark_the_tokens_the_trained_version_sampled():
    s1, s2 = sample(3, 2), sample(2, 3)
    s1.versions[:] = [4, 5]
    s2.versions[:] = [5, 5, 3]
    (mb,) = rl_micro_batches([s1, s2], budget=64, device=torch.device("cpu"), version=5)
    assert mb.loss_input.current.tolist() == [0, 0, 0, 1, 0, 1, 1, 0]
    (mb,) = rl_micro_batches([s1, s2], budget=64, device=torch.device("cpu"))
    assert mb.loss_input.current is None


def test_micro_batches_carry_each_tokens_tenth_and_lag():
    s1, s2 = sample(3, 2), sample(2, 3)
    s1.versions[:] = [4, 5]
    s2.versions[:] = [5, 5, 3]
    (mb,) = rl_micro_batches([s1, s2], budget=64, device=torch.device("cpu"), version=5)
    # s1: 2 prompt targets, then j = 0, 1 of n = 2 (tenths 1 and 6); s2: 1 prompt target, then tenths 1, 4, 7
    assert mb.loss_input.tenth.tolist() == [0, 0, 1, 6, 0, 1, 4, 7]
    assert mb.loss_input.lag.tolist() == [0, 0, 1, 0, 0, 0, 0, 2]  # 5 - the token's version; 0 off the mask
    (mb,) = rl_micro_batches([s1, s2], budget=64, device=torch.device("cpu"))
    assert mb.loss_input.tenth is None and mb.loss_input.lag is None  # no trained version given


def test_micro_batches_carry_the_packers_offsets():
    """Every RL micro-batch carries its row's document offsets, the ones its positions give."""
    rng = random.Random(3)
    samples = [sample(rng.randint(2, 9), rng.randint(1, 20), gid=i) for i in range(12)]
    for mb in rl_micro_batches(samples, 40, torch.device("cpu"), version=0):
        assert mb.documents is not None and mb.documents.cu_seqlens is not None
        ref = Documents.from_positions(mb.position_ids)
        assert mb.documents.spans == ref.spans and mb.documents.cu_seqlens.tolist() == ref.cu_seqlens.tolist()


def test_micro_batches_carry_the_loss_tokens_as_indices_built_on_the_host():
    """`logprob_index` is the loss mask's nonzero positions (what the model would otherwise read from the device),
    environment tokens of a multi-turn sample excluded."""
    rng = random.Random(4)
    samples = [sample(rng.randint(2, 9), rng.randint(1, 20), gid=i) for i in range(12)]
    samples[0] = sample(5, 10)
    samples[0].versions[1:3] = [ENV_VERSION, ENV_VERSION]
    seen_env = False
    for mb in rl_micro_batches(samples, 40, torch.device("cpu"), version=0):
        assert mb.logprob_index is not None and mb.logprob_index.dtype == torch.long
        assert mb.logprob_index.tolist() == mb.loss_input.mask.nonzero().squeeze(1).tolist()
        seen_env |= bool(((mb.loss_input.mask == 0) & (mb.loss_input.position >= 0)).any())
    assert seen_env


def test_micro_batches_are_pinned_and_copied_asynchronously_on_cuda_only():
    from pipelinerl_fsdp.rl.batching import pinned_copies, to_device

    assert pinned_copies(torch.device("cuda", 0)) and pinned_copies(torch.device("cuda"))
    assert not pinned_copies(torch.device("cpu")) and not pinned_copies(torch.device("meta"))
    t = torch.arange(5)
    assert to_device(t, torch.device("cpu")) is t and not t.is_pinned()  # on CPU nothing is copied or pinned
    (mb,) = rl_micro_batches([sample(3, 2), sample(2, 3)], budget=64, device=torch.device("cpu"), version=0)
    assert mb.input_ids.device.type == "cpu" and mb.loss_input.mask.device.type == "cpu"
    assert mb.loss_input.seq.data_ptr() == mb.seq_index.data_ptr()  # the loss's sequence index is the row's


def reference_fields(samples: list[Sample], budget: int, version: int | None) -> list[dict]:
    """The micro-batches of `rl_micro_batches` built token by token in Python (the packer before it was vectorised):
    `pack_row` and `per_target` over per-token lists, the fields from their per-sequence definitions."""
    from pipelinerl_fsdp.episodes import turn_spans
    from pipelinerl_fsdp.rl.packing import nonzero_index, pack_into_bins, pack_row, per_target
    from pipelinerl_fsdp.rl.positions import tenth

    def turns(v: list[int]) -> list[int]:
        out = [0] * len(v)
        for i, (a, b) in enumerate(turn_spans(v), 1):
            out[a:b] = [i] * (b - a)
        return out

    def tenths(v: list[int]) -> list[int]:
        n = sum(x != ENV_VERSION for x in v)
        model = iter(range(n))
        return [0 if x == ENV_VERSION else tenth(next(model), n) for x in v]

    def after_update(v: list[int]) -> list[float]:
        first = next((x for x in v if x != ENV_VERSION), 0)
        return [float(x != ENV_VERSION and x > first) for x in v]

    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    per_token: dict[str, list[list[float]]] = {}
    for s in samples:
        pad, n = len(s.prompt_ids) - 1, len(s.completion_ids)
        rows = {
            "mask": [float(v != ENV_VERSION) for v in s.versions],
            "behaviour_logp": list(s.logprobs),
            "advantage": [s.advantage] * n,
            "weight": [s.loss_weight] * n,
        }
        if version is not None:
            rows["current"] = [float(v == version) for v in s.versions]
            rows["after_update"] = after_update(s.versions)
            rows["position"] = [float(i) for i in range(n)]
            rows["tenth"] = [float(i) for i in tenths(s.versions)]
            rows["turn"] = [float(i) for i in turns(s.versions)]
            rows["lag"] = [float(version - v) if v != ENV_VERSION else 0.0 for v in s.versions]
        for k, v in rows.items():
            per_token.setdefault(k, []).append([-1.0 if k == "position" else 0.0] * pad + v)
    out = []
    for b in pack_into_bins([len(s) for s in seqs], budget):
        row = pack_row([seqs[i] for i in b])
        fields = {k: per_target([seqs[i] for i in b], [v[i] for i in b], k, "cpu") for k, v in per_token.items()}
        index = nonzero_index([m for i in b for m in per_token["mask"][i]], "cpu")
        out.append({**vars(row), "logprob_index": index, **fields, "n_seq": len(b)})
    return out


def random_samples(rng: random.Random, n: int) -> list[Sample]:
    """Prompts of 1-9 tokens, completions of 0-40 with environment runs (multi-turn), versions 2..6, in-flight
    updates within sequences, random advantages and loss weights."""
    out = []
    for i in range(n):
        p, c = rng.randint(1, 9), rng.randint(0, 40)
        p = max(p, 2 - c)
        versions, v = [], rng.randint(2, 5)
        for _ in range(c):
            v = min(6, v + (rng.random() < 0.1))
            versions.append(ENV_VERSION if rng.random() < 0.15 else v)
        s = Sample(
            i // 4,
            [rng.randrange(50) for _ in range(p)],
            [rng.randrange(50) for _ in range(c)],
            [-rng.random() * 3 for _ in range(c)],
            versions,
            float(rng.random() < 0.5),
            rng.uniform(-2, 2),
        )
        s.loss_weight = rng.random()
        out.append(s)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_equal_the_token_by_token_packer(seed: int):
    """The vectorised packer gives every micro-batch of the token-by-token one, bit for bit: rows, offsets, loss
    indices and every loss field (multi-turn environment runs, in-flight updates, prompts of 1 token, empty
    completions), with and without a trained version."""
    rng = random.Random(seed)
    samples = random_samples(rng, rng.randint(1, 30))
    budget = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) + rng.randint(0, 80)
    for version in (None, 5):
        got = rl_micro_batches(samples, budget, torch.device("cpu"), version)
        want = reference_fields(samples, budget, version)
        assert len(got) == len(want)
        for mb, ref in zip(got, want):
            for k in ("input_ids", "position_ids", "targets", "seq_index", "logprob_index"):
                assert torch.equal(getattr(mb, k), ref[k]), k
            assert mb.documents.spans == ref["documents"].spans and mb.documents.max_len == ref["documents"].max_len
            assert torch.equal(mb.documents.cu_seqlens, ref["documents"].cu_seqlens)
            fields = [k for k in ref if k in vars(mb.loss_input) and k != "n_seq"]
            assert len(fields) == (10 if version is not None else 4)
            for k in fields:
                assert torch.equal(getattr(mb.loss_input, k), ref[k]), (k, getattr(mb.loss_input, k), ref[k])
            assert torch.equal(mb.loss_input.seq, ref["seq_index"][0]) and mb.loss_input.n_seq == ref["n_seq"]


def test_micro_batches_refuse_samples_whose_lists_disagree():
    s = sample(3, 4)
    s.versions.pop()
    with pytest.raises(ValueError, match="sample 0: 3 prompt tokens .* 4 completion tokens with 4 log-probs and 3"):
        rl_micro_batches([s], 64, torch.device("cpu"), version=0)
