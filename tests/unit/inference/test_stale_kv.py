"""Stale KV (`inference.kv_max_age`): which caches an update recomputes, the reference engine recomputing exactly
those, and the metric of the tokens sampled over an older cache (`mismatch_kl_after_update`)."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from kv_reference import full_logprobs, logprobs_old_kv_then_new
from pipelinerl_fsdp.inference.engine import Request, stale_kv
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rl.batching import completion_fields, rl_micro_batches
from pipelinerl_fsdp.rl.loss import LossInput, LossStats, policy_loss
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig
from pipelinerl_fsdp.rl.step_metrics import mismatch
from pipelinerl_fsdp.samples import Sample

ARGS = flavour_args("debug", vocab_size=40)
T = 0.8


def test_stale_kv_by_age():
    kv = [-1, 0, 1, 2, 3]  # no cache yet, then caches computed by versions 0..3
    assert stale_kv(kv, 4, -1) == [False] * 5  # keep: never
    assert stale_kv(kv, 4, 0) == [False, True, True, True, True]  # every cache older than the new weights
    assert stale_kv(kv, 4, 1) == [False, True, True, True, False]  # more than one version behind 4
    assert stale_kv(kv, 4, 3) == [False, True, False, False, False]
    assert stale_kv(kv, 4, 4) == [False] * 5


def after_update_marks(versions: list[int]) -> list[float]:
    """`completion_fields`' after-update marks of one completion."""
    v = torch.tensor(versions, dtype=torch.long)
    return completion_fields(v, torch.zeros_like(v), 1, version=0)["after_update"].tolist()


def test_after_update_marks_tokens_sampled_after_an_update_within_the_sequence():
    assert after_update_marks([2, 2, 3, 3, 5]) == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert after_update_marks([4, 4]) == [0.0, 0.0]
    assert after_update_marks([]) == []


class NewWeights:
    """A receiver whose buckets are another model's weights (what `WeightReceiver.receive_buckets` does in place)."""

    def __init__(self, engine: ReferenceEngine, model: torch.nn.Module) -> None:
        self.engine, self.model = engine, model

    def receive_buckets(self) -> None:
        self.engine.load_weights(list(self.model.state_dict().items()))


@pytest.mark.parametrize("max_age", [-1, 0, 1])
def test_reference_engine_recomputes_exactly_the_stale_caches(max_age: int):
    """Two requests in flight at the update to version 2, one prefilled under version 0 and one under version 1:
    age -1 keeps both caches, 0 recomputes both, 1 only the one two versions behind. A recomputed request's later
    log-probs equal a full forward under the new weights; a kept one's equal old-KV-then-new."""
    v0, v1, v2 = (build_model(ARGS, seed=s) for s in (1, 2, 3))
    engine = ReferenceEngine(copy.deepcopy(v0), max_num_seqs=4, max_len=64, eos_ids=[], temperature=T, seed=4)
    a, b = Request(0, [3, 4, 5], max_tokens=10), Request(1, [6, 7, 8, 9], max_tokens=10)
    engine.add(a)
    for _ in range(3):
        engine.step()
    engine.load_weights(list(v1.state_dict().items()))
    engine.set_version(1)
    engine.add(b)
    for _ in range(2):
        engine.step()
    assert (a.kv_version, b.kv_version) == (0, 1)
    n = engine.load_update(NewWeights(engine, v2), 2, max_age)
    recomputed = {-1: set(), 0: {0, 1}, 1: {0}}[max_age]
    assert n == len(recomputed)
    while engine.num_unfinished():
        engine.step()
    for r, old in ((a, None), (b, v1)):
        m = r.versions.index(2)
        lp = torch.tensor(r.logprobs[m:])
        if r.request_id in recomputed:
            assert r.kv_version == 2
            torch.testing.assert_close(lp, full_logprobs(v2, r.prompt_ids, r.tokens, T)[m:], rtol=1e-5, atol=1e-5)
        elif old is not None:  # b: its whole cache came from version 1
            kept = logprobs_old_kv_then_new(old, v2, r.prompt_ids, r.tokens, m, T)
            torch.testing.assert_close(lp, kept, rtol=1e-5, atol=1e-5)
            assert (lp - full_logprobs(v2, r.prompt_ids, r.tokens, T)[m:]).abs().max() > 1e-3
        else:  # a kept a cache of two versions: at least it is not the recomputed one
            assert (lp - full_logprobs(v2, r.prompt_ids, r.tokens, T)[m:]).abs().max() > 1e-3


def test_mismatch_after_update_counts_only_lag0_tokens_after_an_update():
    """Two sequences: the first all lag 0 with no update inside; the second with an update after its first two
    tokens. Only the second's last two tokens are lag 0 after an update; their k3 mean is the metric."""
    log_ratio = torch.tensor([0.0, 0.1, 0.0, 0.3, -0.2, 0.4])
    behaviour = torch.zeros(6)
    mask = torch.ones(6)
    seq = torch.tensor([0, 0, 1, 1, 1, 1])
    current = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    after = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    batch = LossInput(mask, behaviour, torch.ones(6), torch.ones(6), seq, current=current, after_update=after)
    _, stats = policy_loss(log_ratio, batch, ReinforceTISConfig())
    k3 = torch.expm1(log_ratio) - log_ratio
    assert stats.lag0_after_update_tokens == 2.0
    assert stats.lag0_after_update_k3 == pytest.approx(float(k3[4] + k3[5]), rel=1e-6)
    sums = LossStats(lag0_tokens=stats.lag0_tokens, lag0_k3=stats.lag0_k3, lag0_abs_log_ratio=stats.lag0_abs_log_ratio)
    sums = replace(sums, lag0_after_update_tokens=2.0, lag0_after_update_k3=stats.lag0_after_update_k3)
    m = mismatch(sums)
    assert m["mismatch_kl_after_update"] == pytest.approx(float(k3[4] + k3[5]) / 2, rel=1e-6)
    assert m["lag0_after_update_frac"] == pytest.approx(2 / 4)
    assert m["mismatch_kl"] == pytest.approx(float(k3[0] + k3[1] + k3[4] + k3[5]) / 4, rel=1e-6)
    none = mismatch(replace(sums, lag0_after_update_tokens=0.0, lag0_after_update_k3=0.0))
    assert none["mismatch_kl_after_update"] != none["mismatch_kl_after_update"]  # NaN: no such token this step


def test_mismatch_by_position_sums_lag0_tokens_per_completion_range():
    """Lag-0 tokens at completion positions 0, 31, 32 and 130 (and one at 5 of lag 1): the k3 mean per range counts
    each lag-0 token in its range only; a range without lag-0 tokens is NaN, and the batching gives each completion
    token its index."""
    log_ratio = torch.tensor([0.1, -0.2, 0.3, 0.5, 0.7])
    position = torch.tensor([0.0, 31.0, 32.0, 130.0, 5.0])
    current = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    ones = torch.ones(5)
    batch = LossInput(ones, torch.zeros(5), ones, ones, current=current, position=position)
    _, stats = policy_loss(log_ratio, batch, ReinforceTISConfig())
    k3 = torch.expm1(log_ratio) - log_ratio
    assert stats.lag0_tokens_pos[0] == 2.0 and stats.lag0_tokens_pos[2] == 0.0  # ranges 0-31 and 64-127
    m = mismatch(stats)
    assert m["mismatch_kl_pos/0-31"] == pytest.approx(float(k3[0] + k3[1]) / 2, rel=1e-6)
    assert m["mismatch_kl_pos/32-63"] == pytest.approx(float(k3[2]), rel=1e-6)
    assert m["mismatch_kl_pos/128+"] == pytest.approx(float(k3[3]), rel=1e-6)
    assert math.isnan(m["mismatch_kl_pos/64-127"])
    s = Sample(
        group_id=0, prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.1, -0.2], versions=[0, 0], reward=1.0
    )
    (mb,) = rl_micro_batches([s], 64, torch.device("cpu"), version=0)
    assert mb.loss_input.position.tolist() == [-1.0, -1.0, 0.0, 1.0]
