"""The RL step's loss around the chosen objective (`loss.name`, rl/objectives/): the engine/trainer mismatch mask,
the per-sample normalisation weights (rl/normalization.py), an optional KL penalty to a frozen reference (k3
estimator), and the sums behind the step's ESS, clipping and mismatch metrics (docs/objective.md).

All inputs are per output token of one packed micro-batch, flattened; `mask` is 1 on the tokens that count
(generated tokens), 0 elsewhere.
"""

from __future__ import annotations

import torch

from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.rl.objectives import OBJECTIVES, Tokens

# |log pi_ref - log pi| is clamped here before exp() in the k3 estimator: one token the policy has moved far from
# the reference would otherwise give an unbounded penalty and gradient (PipelineRL clamps it the same way).
KL_LOG_RATIO_CLAMP = 10.0
# Completion-token positions at which the lag-0 mismatch is also summed per range ([0, 32), [32, 64), [64, 128),
# [128, ...)): a KV cache kept from older weights (or numerics that drift with context length) shows as a mismatch
# that grows with the position in the completion.
POSITION_BINS = (0, 32, 64, 128)


# Model turns of a multi-turn episode whose importance weights are also summed per turn index (the last counts every
# later turn): the ESS of each turn (`ess_turn/<i>`).
TURN_BINS = 8


def turn_sum_keys() -> list[str]:
    """The loss sums of the raw importance weights per model-turn index (`policy_loss`)."""
    return [f"turn{i}_{kind}" for i in range(1, TURN_BINS + 1) for kind in ("tokens", "rho", "rho2")]


def position_bin_names() -> list[str]:
    """Names of the ranges of POSITION_BINS: "0-31", "32-63", "64-127", "128+"."""
    ends = [f"-{b - 1}" for b in POSITION_BINS[1:]] + ["+"]
    return [f"{lo}{end}" for lo, end in zip(POSITION_BINS, ends)]


def position_sum_keys() -> list[str]:
    """The loss sums of the lag-0 mismatch per position range (`policy_loss`)."""
    return [f"lag0_{kind}_pos{name}" for name in position_bin_names() for kind in ("tokens", "k3")]


def mismatch_masks(t: Tokens, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens a masking rule (MIS / IcePop) would keep, per token: (token rule: rho_t within [low, high];
    sequence rule: the geometric mean of the sequence's rho within [low, high], at each of its tokens)."""
    lr = t.log_ratio.detach()
    lo, hi = torch.log(torch.tensor(low, dtype=lr.dtype)), torch.log(torch.tensor(high, dtype=lr.dtype))
    token = ((lr >= lo) & (lr <= hi)).to(lr.dtype)
    geo = t.seq_mean(lr)
    sequence = t.per_token(((geo >= lo) & (geo <= hi)).to(lr.dtype))
    return token, sequence


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    cfg: LossConfig,
    seq: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    after_update: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
    turn: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch: sum_t weight_t * keep_t * L_t (+ kl_coef * sum_t weight_t * k3_t), L_t the
    objective's per-token loss (`cfg.name`), weight_t its sample's normalisation weight (`loss.normalize`), keep_t
    the mismatch mask (`loss.mask`: 1 everywhere with "none"). `seq`: the sequence index of each position (one
    sequence when None).

    Returns the loss and summed statistics: sum_rho, sum_rho2 of the raw importance weights rho = pi / mu (the
    paper's ESS); sum_w, sum_w2 of the weights the update applies (the truncated ones for REINFORCE-type
    objectives, the unclipped ratio for PPO-type ones, whose clipping acts on the objective); tokens, kl,
    clipped; masked (tokens the mask left out); mis_tokens / mis_seqs and sequences: tokens and sequences that the
    token and the sequence masking rule would leave out with [mask_low, mask_high], whichever rule is on;
    max_log_ratio (a max, not a sum). `current` (1 on tokens sampled by the weights being trained, lag 0): there
    rho differs from 1 only by the engine/trainer mismatch (kernels, dtype, a wrong tokenizer or template); summed
    as lag0_tokens, lag0_k3 (k3 estimate of KL(engine || trainer): rho - 1 - log rho, on the engine's samples)
    and lag0_abs_log_ratio; of those, the tokens `after_update` marks (sampled after an in-flight update within
    their sequence: over a KV cache older weights computed, unless the engine recomputed it) as
    lag0_after_update_tokens and lag0_after_update_k3. `position` (each token's index in its completion): the
    lag-0 tokens and k3 sums per range of POSITION_BINS as lag0_tokens_pos<range> and lag0_k3_pos<range>. `turn`
    (each token's model-turn index, from 1; 0 elsewhere): tokens, sum rho and sum rho^2 per turn index as
    turn<i>_tokens, turn<i>_rho, turn<i>_rho2 (i up to TURN_BINS, the last counting every later turn).
    """
    objective = OBJECTIVES.get(cfg.name)
    if objective is None:
        raise ValueError(f"unknown loss {cfg.name!r}; registered: {sorted(OBJECTIVES)}")
    log_ratio = (logp - behaviour_logp).clamp(max=30.0)  # exp() stays finite for wildly stale tokens
    if seq is None:
        seq = torch.zeros_like(mask, dtype=torch.long)
    n_seq = int(seq.max()) + 1 if seq.numel() else 0
    t = Tokens(logp, log_ratio, advantages, mask, seq, n_seq)
    token_keep, seq_keep = mismatch_masks(t, cfg.mask_low, cfg.mask_high)
    keep = {"none": torch.ones_like(mask), "token": token_keep, "sequence": seq_keep}[cfg.mask]
    out = objective(t, cfg)
    counted = mask * keep
    loss = (out.loss * counted * weight).sum()
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0:
        d = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * (kl * mask * weight).sum()
        kl_sum = float((kl.detach() * mask).sum())
    rho = torch.exp(log_ratio.detach())
    lag0 = mask * current if current is not None else torch.zeros_like(mask)
    w, raw = out.weights * counted, rho * mask
    has_tokens = t.seq_sum(torch.ones_like(mask)) > 0
    stats = {
        "sum_rho": float(raw.sum()),
        "sum_rho2": float((raw * rho).sum()),
        "sum_w": float(w.sum()),
        "sum_w2": float((w * out.weights).sum()),
        "tokens": float(mask.sum()),
        "kl": kl_sum,
        "clipped": float((out.clipped * mask).sum()),
        "masked": float((mask * (1 - keep)).sum()),
        "mis_tokens": float((mask * (1 - token_keep)).sum()),
        "mis_seqs": float(((t.seq_sum(1 - seq_keep) > 0) & has_tokens).sum()),
        "sequences": float(has_tokens.sum()),
        "max_log_ratio": float(log_ratio.detach().masked_fill(mask == 0, float("-inf")).max())
        if mask.any()
        else float("-inf"),
        **lag0_mismatch_sums(log_ratio.detach(), lag0),
    }
    late = lag0_mismatch_sums(log_ratio.detach(), lag0 * after_update if after_update is not None else 0 * mask)
    stats["lag0_after_update_tokens"], stats["lag0_after_update_k3"] = late["lag0_tokens"], late["lag0_k3"]
    if position is not None:
        edges = [*POSITION_BINS[1:], float("inf")]
        for lo, hi, name in zip(POSITION_BINS, edges, position_bin_names()):
            in_bin = ((position >= lo) & (position < hi)).to(lag0.dtype)
            part = lag0_mismatch_sums(log_ratio.detach(), lag0 * in_bin)
            stats[f"lag0_tokens_pos{name}"], stats[f"lag0_k3_pos{name}"] = part["lag0_tokens"], part["lag0_k3"]
    if turn is not None:
        for i in range(1, TURN_BINS + 1):
            in_turn = mask * ((turn == i) if i < TURN_BINS else (turn >= i)).to(mask.dtype)
            stats[f"turn{i}_tokens"] = float(in_turn.sum())
            stats[f"turn{i}_rho"] = float((rho * in_turn).sum())
            stats[f"turn{i}_rho2"] = float((rho * rho * in_turn).sum())
    return loss, stats


def lag0_mismatch_sums(log_ratio: torch.Tensor, lag0: torch.Tensor) -> dict[str, float]:
    """Sums over the tokens where `lag0` is 1 of the k3 term rho - 1 - log rho (>= 0; its mean estimates
    KL(engine || trainer) from the engine's samples) and of |log rho|, rho = pi_trainer / pi_engine."""
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "lag0_tokens": float(lag0.sum()),
        "lag0_k3": float((k3 * lag0).sum()),
        "lag0_abs_log_ratio": float((log_ratio.abs() * lag0).sum()),
    }


def micro_batch_loss(
    logp: torch.Tensor, entropy: torch.Tensor, micro_batch: dict[str, torch.Tensor], cfg: LossConfig, kl_coef: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss` on one packed micro-batch (`rl.batching.rl_micro_batches`'s fields; `ref_logp` when a
    reference model scored it), with the summed entropy of its counted tokens added to the statistics."""
    mb, mask = micro_batch, micro_batch["mask"][0]
    ref = mb["ref_logp"][0] if "ref_logp" in mb else None
    current = mb["current"][0] if "current" in mb else None
    after_update = mb["after_update"][0] if "after_update" in mb else None
    position = mb["position"][0] if "position" in mb else None
    turn = mb["turn"][0] if "turn" in mb else None
    loss, stats = policy_loss(
        logp[0],
        mb["behaviour_logp"][0],
        mb["advantage"][0],
        mask,
        mb["weight"][0],
        cfg,
        mb["seq_index"][0],
        ref,
        current,
        kl_coef,
        after_update,
        position,
        turn,
    )
    stats["entropy"] = float((entropy[0] * mask).sum())
    return loss, stats
