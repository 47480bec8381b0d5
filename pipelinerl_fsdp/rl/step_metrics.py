"""The metrics of one RL step, computed from the step's samples, the loss statistics reduced over trainer ranks
(`LossStats`), the engines' cumulative counters summed over the engines (`EngineStats`) and the step's timings
(pure: every number comes from these inputs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipelinerl_fsdp.episodes import turn_spans
from pipelinerl_fsdp.rewards.outcomes import OUTCOMES
from pipelinerl_fsdp.rl.batching import completion_fields, flat
from pipelinerl_fsdp.rl.ess import ess_from_sums
from pipelinerl_fsdp.rl.loss import LossStats, position_bin_names
from pipelinerl_fsdp.rl.positions import TENTHS
from pipelinerl_fsdp.samples import ENV_VERSION, EngineStats, Sample, model_versions


def update_pauses(
    now: EngineStats, before: tuple[float, float], maxima: dict[int, float]
) -> tuple[dict[str, float], tuple[float, float]]:
    """The weight-update pauses the engines reported during a step: mean (the step's share of the cumulative
    `pause_ms_sum` / `updates` of the engines, `now` their total) and max (the longest each engine reported
    meanwhile); NaN when no update was reported. Returns the metrics and the cumulative (sum, count) to pass as
    `before` next time."""
    total = (now.pause_ms_sum, now.updates)
    n = total[1] - before[1]
    mean = (total[0] - before[0]) / n if n > 0 else float("nan")
    longest = max(maxima.values()) if n > 0 and maxima else float("nan")
    return {"update_pause_ms": mean, "update_pause_ms_max": longest}, total


@dataclass
class StepTimes:
    start: float  # the step began (before waiting for data)
    data: float  # the batch was in hand
    end: float  # optimizer step and weight push done
    previous_end: float  # the previous step's end (rates are per wall-clock interval)
    push_blocked_s: float = 0.0  # of data..end, the trainer's time blocked on weight pushes (not computing)


def token_lags(samples: list[Sample], trained_version: int) -> list[int]:
    """Per sampled completion token (environment tokens have no version): versions between the weights trained
    (`trained_version`) and those that sampled it."""
    return [trained_version - v for s in samples for v in model_versions(s.versions)]


# `lag_frac/<bin>`: the step's token lags by range, inclusive (None: no upper end)
LAG_BINS: tuple[tuple[int, int | None], ...] = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, None))


def lag_bin_names() -> list[str]:
    """Names of LAG_BINS: "0", "1", "2", "3", "4-7", "8-15", "16+"."""
    return [f"{lo}" if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}" for lo, hi in LAG_BINS]


def nearest_rank(sorted_values: list[int], p: int) -> float:
    """The p-th percentile (p in 1..100) by nearest rank: the value at rank ceil(p N / 100) (from 1) of the N values
    sorted ascending, the smallest value that at least p% of the values do not exceed (so always one of them; the
    median of an even count is the lower middle one). NaN when there are none."""
    if not 1 <= p <= 100:
        raise ValueError(f"percentile {p} outside 1..100")
    if not sorted_values:
        return float("nan")
    return float(sorted_values[-(-p * len(sorted_values) // 100) - 1])


def lag_distribution(samples: list[Sample], trained_version: int) -> dict[str, float]:
    """The spread of the step's per-token lags (`token_lags`): `lag_p50`, `lag_p90` (`nearest_rank`);
    `lag_frac/<bin>`, the share of the sampled tokens whose lag falls in each range of LAG_BINS (summing to 1);
    `lag_pos/<i>`, the mean lag of the tokens in the i-th tenth of their completion (rl/positions.py), i = 1..10.
    NaN where there is no token to measure (a tenth no completion reached: completions under 10 tokens). Vector
    operations over the step's tokens (`completion_fields`), not a Python loop: the trainer computes this every step."""
    versions = flat((s.versions for s in samples), np.int64)
    sample = torch.repeat_interleave(
        torch.arange(len(samples)), torch.tensor([len(s.versions) for s in samples], dtype=torch.long)
    )
    fields = completion_fields(versions, sample, len(samples), trained_version)
    lags = fields["lag"][versions != ENV_VERSION].long()  # environment tokens have no version, so no lag
    n = len(lags)
    ordered = lags.sort().values.tolist()
    out = {"lag_p50": nearest_rank(ordered, 50), "lag_p90": nearest_rank(ordered, 90)}
    for name, (lo, hi) in zip(lag_bin_names(), LAG_BINS):
        inside = (lags >= lo) if hi is None else (lags >= lo) & (lags <= hi)
        out[f"lag_frac/{name}"] = int(inside.sum()) / n if n else float("nan")
    tenth = fields["tenth"].long()  # 0: an environment token, in no tenth
    total = torch.zeros(TENTHS + 1, dtype=torch.float64).index_add_(0, tenth, fields["lag"].double()).tolist()
    count = torch.zeros(TENTHS + 1, dtype=torch.long).index_add_(0, tenth, torch.ones_like(tenth)).tolist()
    for i in range(1, TENTHS + 1):
        out[f"lag_pos/{i}"] = total[i] / count[i] if count[i] else float("nan")
    return out


def position_metrics(sums: LossStats) -> dict[str, float]:
    """Per tenth i = 1..10 of the completions (rl/positions.py), over all their sampled tokens whatever the lag:
    `ess_pos/<i>`, the ESS of the raw importance weights there (as `ess`), and `abs_log_ratio_pos/<i>`, the mean
    |log pi_theta - log mu|. The first tenth against the last: whether the early, staler tokens of long completions
    carry less of the learning signal. NaN for a tenth with no token."""
    out = {}
    for i, (n, rho, rho2) in enumerate(zip(sums.tenth_tokens, sums.tenth_rho, sums.tenth_rho2), 1):
        out[f"ess_pos/{i}"] = ess_from_sums(rho, rho2, n)
    for i, (n, a) in enumerate(zip(sums.tenth_tokens, sums.tenth_abs_log_ratio), 1):
        out[f"abs_log_ratio_pos/{i}"] = a / n if n > 0 else float("nan")
    return out


def zero_advantage_group_frac(samples: list[Sample]) -> float:
    """Share of the batch's groups whose attempts all got the same reward (no learning signal)."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group_id, set()).add(s.reward)
    return sum(1 for r in rewards.values() if len(r) == 1) / max(len(rewards), 1)


def outcome_fractions(samples: list[Sample]) -> dict[str, float]:
    """`outcome/<kind>`: share of the batch's samples per reward outcome (correct, wrong, no_answer, ...)."""
    n = max(len(samples), 1)
    return {f"outcome/{name}": sum(1 for s in samples if s.outcome == code) / n for code, name in enumerate(OUTCOMES)}


TOOL_COUNTERS = ("tool_calls", "tool_timeout", "tool_error", "tool_output_truncated")


def episode_metrics(samples: list[Sample], trained_version: int) -> dict[str, float]:
    """A multi-turn step's episodes: model turns (mean, max), environment tokens and policy versions per episode,
    and `lag_turn/<i>`, the mean lag of the tokens of each episode's i-th model turn (i from 1). (`ess_turn/<i>`, the
    ESS of those tokens, comes from the loss sums: `step_metrics`.)"""
    spans = [turn_spans(s.versions) for s in samples]
    by_turn: dict[int, list[int]] = {}
    for s, sp in zip(samples, spans):
        for i, (a, b) in enumerate(sp, 1):
            by_turn.setdefault(i, []).extend(trained_version - v for v in s.versions[a:b])
    n = max(len(samples), 1)
    return {
        "turns_per_episode": sum(len(sp) for sp in spans) / n,
        "turns_max": float(max((len(sp) for sp in spans), default=0)),
        "env_tokens_per_episode": sum(sum(1 for v in s.versions if v == ENV_VERSION) for s in samples) / n,
        "versions_per_episode": sum(len(set(model_versions(s.versions))) for s in samples) / n,
        **{f"lag_turn/{i}": sum(lags) / len(lags) for i, lags in sorted(by_turn.items()) if lags},
    }


def mismatch(sums: LossStats) -> dict[str, float]:
    """`mismatch_kl` and `mismatch_abs_log_ratio`: means over the step's lag-0 tokens (`rl.loss.policy_loss`);
    `mismatch_kl_after_update`: the k3 mean over those of them sampled after an in-flight update within their
    sequence (the stale-KV effect: old-weight KV, new weights), `lag0_after_update_frac` their share;
    `mismatch_kl_pos/<range>`: the k3 mean over the lag-0 tokens at that range of positions in their completion
    (rl.loss.POSITION_BINS). NaN where a step has no such token."""
    nan = float("nan")
    n, late = sums.lag0_tokens, sums.lag0_after_update_tokens
    by_pos = {}
    for name, k, k3 in zip(position_bin_names(), sums.lag0_tokens_pos, sums.lag0_k3_pos):
        by_pos[f"mismatch_kl_pos/{name}"] = k3 / k if k > 0 else nan
    return {
        **by_pos,
        "mismatch_kl": sums.lag0_k3 / n if n > 0 else nan,
        "mismatch_abs_log_ratio": sums.lag0_abs_log_ratio / n if n > 0 else nan,
        "mismatch_kl_after_update": sums.lag0_after_update_k3 / late if late > 0 else nan,
        "lag0_after_update_frac": late / n if n > 0 else nan,
    }


def mismatch_error(sums: LossStats, bound: float) -> str | None:
    """Why the engine's and the trainer's log-probs of the same lag-0 tokens disagree beyond `bound` (mean
    |log ratio|, `rl.check_mismatch`), or None when they agree (or there are no such tokens to compare)."""
    m = mismatch(sums)
    if not sums.lag0_tokens or m["mismatch_abs_log_ratio"] <= bound:
        return None
    return (
        f"the trainer's log-probs of {sums.lag0_tokens:.0f} tokens that the engines sampled with the same weights "
        f"differ from the engines' by {m['mismatch_abs_log_ratio']:.4g} on average (|log ratio|; KL(engine || "
        f"trainer) {m['mismatch_kl']:.4g}), above rl.check_mismatch = {bound:g}: engine and trainer do not compute "
        "the same distribution (a different model folder, tokenizer or chat template, dtype, temperature or head); "
        "stopping before the first update"
    )


def step_metrics(
    samples: list[Sample],
    trained_version: int,
    sums: LossStats,
    engines: EngineStats,
    engines_before: EngineStats,
    times: StepTimes,
    engine_slots: int = 0,
    multi_turn: bool = False,
) -> dict[str, float]:
    """The step's metrics. `trained_version`: the policy version the step's gradient was computed with;
    `engine_slots`: sequences an engine runs at most (`inference.max_num_seqs`; 0: no occupancy); `multi_turn`: the
    task runs episodes (`episode_metrics`, and the engines' tool calls by outcome during the step)."""
    lags = token_lags(samples, trained_version)
    tokens = max(sums.tokens, 1.0)
    engine_elapsed = max(engines.elapsed_s - engines_before.elapsed_s, 1e-9)
    busy = engines.busy_s - engines_before.busy_s
    occupancy = {}
    seq_s = engines.seq_s - engines_before.seq_s
    if engine_slots and busy > 0:
        # the mean batch while busy over the slots (`inference.max_num_seqs`, in every mode: conventional G=1, whose
        # round is one batch, cannot fill more than batch_size of them): a draining long tail shows here, not in the
        # busy fraction
        occupancy["inference_occupancy"] = seq_s / busy / engine_slots
    episodes = {}
    if multi_turn:
        episodes = episode_metrics(samples, trained_version)
        # the paper's ESS of each model-turn index's tokens (the last: and later)
        for i, (n, rho, rho2) in enumerate(zip(sums.turn_tokens, sums.turn_rho, sums.turn_rho2), 1):
            if n > 0:
                episodes[f"ess_turn/{i}"] = ess_from_sums(rho, rho2, n)
        episodes.update({k: getattr(engines, k) - getattr(engines_before, k) for k in TOOL_COUNTERS})
    return {
        **occupancy,
        **episodes,
        **outcome_fractions(samples),
        **lag_distribution(samples, trained_version),
        **position_metrics(sums),
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        # the paper's ESS, of the raw importance weights; and of the weights the loss applies (truncated at c)
        "ess": ess_from_sums(sums.sum_rho, sums.sum_rho2, sums.tokens),
        # over the tokens the update keeps: a token the mismatch or lag mask leaves out has no weight at all, so
        # counting it would read three kept on-policy tokens of four as 0.75
        "ess_truncated": ess_from_sums(sums.sum_w, sums.sum_w2, sums.kept),
        "lag_mean": sum(lags) / max(len(lags), 1),
        "lag_max": max(lags, default=0),
        "current_version_frac": sum(1 for x in lags if x == 0) / max(len(lags), 1),
        # sequences whose tokens come from more than one policy version (in-flight updates)
        "mixed_version_frac": sum(1 for s in samples if len(set(model_versions(s.versions))) > 1) / len(samples),
        "entropy": sums.entropy / tokens,
        "is_clipped_frac": sums.clipped / tokens,
        # masking (loss.mask, loss.max_token_lag): tokens left out of the loss; and the tokens / sequences
        # the token / sequence rule would leave out with [loss.mask_low, loss.mask_high] whichever rule is on;
        # the largest raw ratio pi / mu of the step
        "masked_frac": sums.masked / tokens,
        "mis_token_frac": sums.mis_tokens / tokens,
        "mis_seq_frac": sums.mis_seqs / max(sums.sequences, 1.0),
        "is_ratio_max": math.exp(sums.max_log_ratio) if sums.tokens > 0 else float("nan"),
        "kl": sums.kl / tokens,
        # engine vs trainer on the tokens the trained weights sampled themselves (lag 0): KL(engine || trainer)
        # (k3) and the mean |log ratio|; NaN in a step with no such token
        **mismatch(sums),
        "completion_len": sums.tokens / len(samples),
        "truncated_frac": sum(1 for s in samples if not s.finished) / len(samples),
        "zero_adv_group_frac": zero_advantage_group_frac(samples),
        "gen_tokens_per_s": (engines.gen_tokens - engines_before.gen_tokens) / (times.end - times.previous_end),
        # the engines' own speed: tokens per second of their busy time (what they can do, not what the trainer takes)
        "gen_tokens_per_busy_s": (engines.gen_tokens - engines_before.gen_tokens) / busy if busy > 0 else float("nan"),
        "train_tokens_per_s": sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
        / (times.end - times.data),
        # busy = computing; blocked = waiting on the other side (trainer: pushes; engines' loops: a full queue)
        "trainer_busy_frac": (times.end - times.data - times.push_blocked_s) / (times.end - times.start),
        "trainer_push_blocked_frac": times.push_blocked_s / (times.end - times.start),
        "inference_busy_frac": busy / engine_elapsed,
        # the sums behind the two fractions above, over the engines' own window (their stats arrive with the groups,
        # so it is not the trainer's step), all engines together: a run's busy fraction and occupancy are sums of
        # these over its steps
        "inference_busy_s": busy,
        "inference_elapsed_s": engine_elapsed,
        "inference_seq_s": seq_s,
        "inference_send_blocked_frac": (engines.send_blocked_s - engines_before.send_blocked_s) / engine_elapsed,
        # sequences in flight whose KV cache the engines recomputed at this step's updates (inference.kv_max_age)
        "kv_recomputed_seqs": engines.kv_recomputed - engines_before.kv_recomputed,
        "wait_for_data_s": times.data - times.start,
        "train_step_s": times.end - times.data,
    }
