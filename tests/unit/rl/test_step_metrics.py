"""Step metrics mean what their names say, computed from the step's samples and counters."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pipelinerl_fsdp.records import total
from pipelinerl_fsdp.rl.loss import LossInput, LossStats, policy_loss
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig
from pipelinerl_fsdp.rl.step_metrics import (
    StepTimes,
    step_metrics,
    token_lags,
    update_pauses,
    zero_advantage_group_frac,
)
from pipelinerl_fsdp.samples import EngineStats, Sample


def s(versions: list[int], reward: float, finished: bool = True) -> Sample:
    return Sample(0, [1, 2, 3], [5] * len(versions), [-1.0] * len(versions), versions, reward, 0.0, finished)


def E(gen_tokens: float, busy_s: float, elapsed_s: float, seq_s: float = 0.0) -> EngineStats:
    return EngineStats(gen_tokens=gen_tokens, busy_s=busy_s, elapsed_s=elapsed_s, seq_s=seq_s)


SUMS = LossStats(
    sum_rho=4.0,
    sum_rho2=4.0,
    sum_w=4.0,
    sum_w2=4.0,
    tokens=4.0,
    kept=4.0,
    entropy=2.0,
    clipped=1.0,
    kl=0.4,
    masked=0.0,
    mis_tokens=0.0,
    mis_seqs=0.0,
    sequences=2.0,
    max_log_ratio=0.0,
)


def test_lags_and_version_fractions():
    samples = [s([3, 4], 1.0), s([4, 4], 0.0, finished=False)]
    assert token_lags(samples, 4) == [1, 0, 0, 0]
    m = step_metrics(
        samples, 4, SUMS, EngineStats(gen_tokens=10, busy_s=2, elapsed_s=4), EngineStats(), StepTimes(0, 1, 2, -1)
    )
    assert m["lag_mean"] == 0.25 and m["lag_max"] == 1 and m["current_version_frac"] == 0.75
    assert m["mixed_version_frac"] == 0.5  # one sequence has tokens of versions 3 and 4
    assert m["reward_mean"] == 0.5 and m["truncated_frac"] == 0.5
    assert m["entropy"] == 0.5 and m["kl"] == pytest.approx(0.1)  # sums per token


def test_ess_and_clipping_from_the_loss_of_known_importance_weights():
    """Weights pi/mu = (2, 0.5, 1, 1) through the real loss, truncated at c = 1.5; the values worked by hand."""
    logp = torch.log(torch.tensor([0.4, 0.1, 0.3, 0.2]))
    behaviour = logp - torch.log(torch.tensor([2.0, 0.5, 1.0, 1.0]))
    _, sums = policy_loss(
        logp, LossInput(torch.ones(4), behaviour, torch.ones(4), torch.full((4,), 0.5)), ReinforceTISConfig(is_clip=1.5)
    )
    m = step_metrics([s([4, 4], 1.0), s([4, 4], 0.0)], 4, replace(sums, entropy=0.0), EngineStats(),
                     EngineStats(), StepTimes(0, 1, 2, 0))  # fmt: skip
    assert m["ess"] == pytest.approx(4.5**2 / (4 * 6.25))  # raw: sum 4.5, sum of squares 6.25 -> 0.81
    assert m["ess_truncated"] == pytest.approx(4.0**2 / (4 * 4.5))  # (1.5, 0.5, 1, 1) -> 0.889
    assert m["is_clipped_frac"] == 0.25  # one token of four above c
    assert m["is_ratio_max"] == pytest.approx(2.0, rel=1e-6)  # the largest raw weight


def test_ess_is_of_the_raw_weights_and_ess_truncated_of_the_applied_ones():
    # raw weights (2, 0, 1, 1): (4)^2 / 6 / 4 = 0.667; applied (truncated) weights (1, 1, 1, 1): 1
    sums = replace(SUMS, sum_rho=4.0, sum_rho2=6.0, sum_w=4.0, sum_w2=4.0)
    m = step_metrics([s([4, 4], 1.0), s([4, 4], 0.0)], 4, sums, EngineStats(), EngineStats(), StepTimes(0, 1, 2, 0))
    assert m["ess"] == pytest.approx(2 / 3) and m["ess_truncated"] == 1.0


def test_ess_truncated_counts_only_the_tokens_the_update_keeps():
    """Four on-policy tokens (pi = mu), the token mask [0.5, 2] leaving out one whose recorded behaviour log-prob is
    off by log 3: the update applies weight 1 to three tokens and nothing to the fourth, so its ESS is 1 (3^2 / 3 /
    3), not the 0.75 of dividing by all four; the raw ESS sees the outlier."""
    logp = torch.log(torch.tensor([0.4, 0.1, 0.3, 0.2]))
    behaviour = logp - torch.log(torch.tensor([1.0, 1.0, 1.0, 3.0]))
    cfg = ReinforceTISConfig(mask="token")
    _, sums = policy_loss(logp, LossInput(torch.ones(4), behaviour, torch.ones(4), torch.full((4,), 0.5)), cfg)
    assert sums.kept == 3 and sums.tokens == 4
    m = step_metrics([s([4, 4], 1.0), s([4, 4], 0.0)], 4, replace(sums, entropy=0.0), EngineStats(),
                     EngineStats(), StepTimes(0, 1, 2, 0))  # fmt: skip
    assert m["ess_truncated"] == pytest.approx(1.0)
    assert m["ess"] == pytest.approx(6.0**2 / (4 * 12.0))  # raw weights (1, 1, 1, 3): 36 / 12 / 4 = 0.75


def test_in_sync_data_has_zero_lag():
    m = step_metrics([s([7, 7, 7], 1.0)], 7, SUMS, EngineStats(), EngineStats(), StepTimes(0, 1, 2, 0))
    assert m["lag_mean"] == 0 and m["lag_max"] == 0 and m["current_version_frac"] == 1.0


def test_rates_and_busy_fractions_come_from_the_deltas():
    before, now = E(100, 5, 10), E(400, 6.5, 12)
    m = step_metrics([s([0], 1.0)], 0, SUMS, now, before, StepTimes(start=10, data=10.5, end=12, previous_end=9))
    assert m["gen_tokens_per_s"] == pytest.approx(300 / 3)  # 300 tokens since the previous step's end
    assert m["gen_tokens_per_busy_s"] == pytest.approx(300 / 1.5)  # ...of which the engines computed 1.5 s
    assert m["inference_busy_frac"] == pytest.approx(1.5 / 2)
    assert m["trainer_busy_frac"] == pytest.approx(1.5 / 2)  # waited 0.5 s of a 2 s step for data
    assert m["wait_for_data_s"] == pytest.approx(0.5) and m["train_step_s"] == pytest.approx(1.5)
    assert m["train_tokens_per_s"] == pytest.approx(3 / 1.5)  # 3 + 1 tokens, 3 targets, in 1.5 s


def test_zero_advantage_groups_are_counted_per_group():
    def g(gid: int, rewards: list[float]) -> list[Sample]:
        return [Sample(gid, [1], [2], [-1.0], [0], r) for r in rewards]

    assert zero_advantage_group_frac(g(0, [1, 1]) + g(1, [0, 1]) + g(2, [0, 0]) + g(3, [1, 0])) == 0.5
    assert zero_advantage_group_frac(g(0, [0, 1])) == 0.0


def test_pass_at_k_hand_computed():
    from pipelinerl_fsdp.training.evaluation import pass_at_k

    # 5 samples, 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@4 = 1 (only 3 wrong)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_eval_reports_join_over_engines():
    from pipelinerl_fsdp.samples import EvalReport
    from pipelinerl_fsdp.training.evaluation import EvalAggregator

    agg = EvalAggregator(["a", "b"], n_engines=2, pass_k=[1, 2])
    assert agg.add(EvalReport(0, 10, 2, [0, 2], [2, 0])) == {}  # engine 0's share: waiting for engine 1
    out = agg.add(EvalReport(0, 10, 2, [1], [1]))
    assert out["eval/a/version"] == 10 and out["eval/a/problems"] == 3
    assert out["eval/a/pass@1"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert out["eval/a/pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert not agg.complete(10)  # set "b" still missing
    agg.add(EvalReport(1, 10, 2, [], []))
    agg.add(EvalReport(1, 10, 2, [0], [0]))
    assert agg.complete(10) and not agg.complete(20)


def test_occupancy_is_the_mean_batch_while_busy_over_the_slots():
    before, now = E(100, 5, 10, 40.0), E(400, 7, 12, 40.0 + 2 * 48)
    m = step_metrics([s([0], 1.0)], 0, SUMS, now, before, StepTimes(0, 1, 2, 0), engine_slots=64)
    assert m["inference_occupancy"] == pytest.approx(48 / 64)  # 48 sequences on average over 2 busy seconds
    # no slot count, or an engine that was never busy: no occupancy rather than a made-up one
    assert "inference_occupancy" not in step_metrics([s([0], 1.0)], 0, SUMS, now, before, StepTimes(0, 1, 2, 0))
    idle = step_metrics([s([0], 1.0)], 0, SUMS, before, before, StepTimes(0, 1, 2, 0), engine_slots=64)
    assert "inference_occupancy" not in idle


def test_update_pauses_are_the_steps_mean_and_max_not_the_last():
    # engine 0 took 3 updates so far (60 ms), engine 1 two (100 ms); at the last record: 1 update of 10 ms
    engines = [EngineStats(pause_ms_sum=60.0, updates=3.0), EngineStats(pause_ms_sum=100.0, updates=2.0)]
    m, both = update_pauses(total(engines, EngineStats()), (10.0, 1.0), {0: 30.0, 1: 70.0})
    assert m["update_pause_ms"] == pytest.approx(150 / 4) and m["update_pause_ms_max"] == 70.0
    assert both == (160.0, 5.0)
    m, _ = update_pauses(total(engines, EngineStats()), both, {})  # nothing new this step
    assert m["update_pause_ms"] != m["update_pause_ms"] and m["update_pause_ms_max"] != m["update_pause_ms_max"]


def test_mismatch_is_the_mean_over_lag0_tokens_and_nan_without_them():
    times = StepTimes(0.0, 1.0, 2.0, 0.0)
    sums = replace(SUMS, lag0_tokens=2.0, lag0_k3=0.01, lag0_abs_log_ratio=0.3)
    m = step_metrics([s([1, 1], 1.0)], 1, sums, EngineStats(), EngineStats(), times)
    assert m["mismatch_kl"] == pytest.approx(0.005) and m["mismatch_abs_log_ratio"] == pytest.approx(0.15)
    m = step_metrics([s([0, 0], 1.0)], 1, replace(SUMS, lag0_tokens=0.0), EngineStats(), EngineStats(), times)
    assert m["mismatch_kl"] != m["mismatch_kl"]  # NaN: no token of the trained version in this step


def test_the_mismatch_check_fails_only_beyond_its_bound_and_names_the_numbers():
    from pipelinerl_fsdp.rl.step_metrics import mismatch_error

    agree = replace(SUMS, lag0_tokens=100.0, lag0_k3=1e-9, lag0_abs_log_ratio=1e-4)
    assert mismatch_error(agree, 0.1) is None
    off = replace(agree, lag0_k3=12.0, lag0_abs_log_ratio=50.0)
    msg = mismatch_error(off, 0.1)
    assert msg is not None and "100 tokens" in msg and "by 0.5 on average" in msg and "0.12" in msg
    assert mismatch_error(replace(off, lag0_tokens=0.0), 0.1) is None  # nothing to compare yet: checked next step


def test_kv_recomputed_seqs_is_the_step_delta_of_the_engines_counters():
    before = EngineStats(kv_recomputed=7.0)
    now = total([EngineStats(kv_recomputed=9.0), EngineStats(kv_recomputed=3.0)], EngineStats())
    m = step_metrics([s([0], 1.0)], 0, SUMS, now, before, StepTimes(0, 1, 2, 0))
    assert m["kv_recomputed_seqs"] == 5.0  # 12 recomputed in all so far, 7 of them before this step


def test_nearest_rank_percentiles_by_hand():
    from pipelinerl_fsdp.rl.step_metrics import nearest_rank

    lags = [0, 0, 1, 1, 2, 3, 5, 8, 13, 20]  # N = 10: p50 -> rank 5, p90 -> rank 9, p100 -> rank 10
    assert (nearest_rank(lags, 50), nearest_rank(lags, 90), nearest_rank(lags, 100)) == (2, 13, 20)
    odd = [0, 1, 1, 2, 4, 6, 9]  # N = 7: p50 -> rank ceil(3.5) = 4, p90 -> rank ceil(6.3) = 7, p1 -> rank 1
    assert (nearest_rank(odd, 50), nearest_rank(odd, 90), nearest_rank(odd, 1)) == (2, 9, 0)
    assert nearest_rank([3], 90) == 3 and nearest_rank([], 50) != nearest_rank([], 50)  # NaN without values
    with pytest.raises(ValueError):
        nearest_rank(lags, 0)


def test_lag_percentiles_bins_and_positions_of_a_step():
    """Two completions trained at version 20: one of 10 tokens sampled at versions 2, 4, ..., 20 (lags 18, 16, ...,
    0, one token per tenth), one of 3 tokens at version 19 (lag 1; tenths 1, 4, 7)."""
    long = s([2, 4, 6, 8, 10, 12, 14, 16, 18, 20], 1.0)
    short = s([19, 19, 19], 0.0)
    m = step_metrics([long, short], 20, SUMS, EngineStats(), EngineStats(), StepTimes(0, 1, 2, 0))
    # 13 lags sorted: 0 1 1 1 2 4 6 8 10 12 14 16 18; p50 -> rank ceil(6.5) = 7, p90 -> rank ceil(11.7) = 12
    assert m["lag_p50"] == 6 and m["lag_p90"] == 16 and m["lag_max"] == 18
    want = {"0": 1, "1": 3, "2": 1, "3": 0, "4-7": 2, "8-15": 4, "16+": 2}
    assert {k: m[f"lag_frac/{k}"] for k in want} == pytest.approx({k: v / 13 for k, v in want.items()})
    assert sum(m[f"lag_frac/{k}"] for k in want) == pytest.approx(1.0)
    # tenth i: the long completion's token i (lag 20 - 2i), and in tenths 1, 4, 7 also a short one's (lag 1)
    expect = {i: 20 - 2 * i for i in range(1, 11)}
    for i in (1, 4, 7):
        expect[i] = (expect[i] + 1) / 2
    assert {i: m[f"lag_pos/{i}"] for i in range(1, 11)} == pytest.approx(expect)


def test_ess_and_abs_log_ratio_by_tenth_through_the_real_loss():
    """A completion of 20 tokens (2 per tenth) and one of 3 (tenths 1, 4, 7), packed and run through the loss:
    tenth 1 holds ratios (2, 1/2) of the long one and 1 of the short one, tenth 2 (3, 3); every other token 1.
    Worked by hand: tenth 1's ESS (3.5)^2 / 5.25 / 3 = 0.778, |log ratio| (2 log 2) / 3; tenth 2's ESS 1 (equal
    weights, far from 1), |log ratio| log 3; the tenths of ratio 1: ESS 1, |log ratio| 0."""
    from pipelinerl_fsdp.rl.batching import rl_micro_batches

    long, short = s([3] * 20, 1.0), s([4, 4, 4], 0.0)
    (mb,) = rl_micro_batches([long, short], 64, torch.device("cpu"), version=4)
    log_ratio = [0.0] * 23
    log_ratio[0:4] = [math.log(2), -math.log(2), math.log(3), math.log(3)]
    tokens = mb.loss_input.mask.nonzero()[:, 0]
    logp = mb.loss_input.behaviour_logp.clone()
    logp[tokens] += torch.tensor(log_ratio)
    _, sums = policy_loss(logp, mb.loss_input, ReinforceTISConfig())
    assert sums.tenth_tokens == (3, 2, 2, 3, 2, 2, 3, 2, 2, 2)
    m = step_metrics([long, short], 4, sums, EngineStats(), EngineStats(), StepTimes(0, 1, 2, 0))
    assert m["ess_pos/1"] == pytest.approx(3.5**2 / 5.25 / 3, rel=1e-6)
    assert m["abs_log_ratio_pos/1"] == pytest.approx(2 * math.log(2) / 3, rel=1e-6)
    assert m["ess_pos/2"] == pytest.approx(1.0) and m["abs_log_ratio_pos/2"] == pytest.approx(math.log(3), rel=1e-6)
    for i in range(3, 11):
        assert m[f"ess_pos/{i}"] == pytest.approx(1.0) and m[f"abs_log_ratio_pos/{i}"] == pytest.approx(0, abs=1e-6)
    # the raw ratios, whatever the lag: the long completion's tokens are all one version old (no lag-0 token there)
    assert sums.lag0_tokens == 3


def test_position_metrics_are_nan_for_an_empty_tenth():
    m = step_metrics([s([4], 1.0)], 4, SUMS, EngineStats(), EngineStats(), StepTimes(0, 1, 2, 0))
    for name in ("ess_pos/3", "abs_log_ratio_pos/3", "lag_pos/3"):
        assert m[name] != m[name], name
    assert m["lag_pos/1"] == 0 and m["lag_p50"] == 0 and m["lag_frac/0"] == 1.0


def test_tenth_sums_count_only_the_masked_in_tokens_by_hand():
    from pipelinerl_fsdp.rl.loss import tenth_sums

    # tenth 1: log ratios 0.1 and (masked out) 5; tenth 2: -0.2; a position of tenth 0 (a prompt target) is nowhere
    tokens, rho, rho2, absolute = (
        tuple(row)
        for row in tenth_sums(
            torch.tensor([1.0, 1.0, 2.0, 0.0]), torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.1, 5.0, -0.2, 3.0])
        ).tolist()
    )
    assert tokens == (1, 1) + (0,) * 8
    assert rho[:3] == pytest.approx((math.exp(0.1), math.exp(-0.2), 0.0))
    assert rho2[:2] == pytest.approx((math.exp(0.2), math.exp(-0.4)))
    assert absolute[:3] == pytest.approx((0.1, 0.2, 0.0)) and sum(absolute[2:]) == 0
