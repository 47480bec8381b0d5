"""The policy-gradient objective (docs/objective.md): truncated importance-weighted REINFORCE, PPO-clip as an
option, and an optional KL penalty to a frozen reference (k3 estimator).

All inputs are per output token, flattened; `mask` is 1 on tokens that count (generated tokens), 0 elsewhere.
"""

from __future__ import annotations

import torch

from pipelinerl_fsdp.rl.objectives import OBJECTIVES, LossSettings

# |log pi_ref - log pi| is clamped here before exp() in the k3 estimator: one token the policy has moved far from
# the reference would otherwise give an unbounded penalty and gradient (PipelineRL clamps it the same way).
KL_LOG_RATIO_CLAMP = 10.0


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_sequences: float,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, normalised by `num_sequences` (B: sequences in the whole optimizer step).

    reinforce: L = -(1/B) sum_t sg(min(rho_t, c)) * A * log pi(a_t), rho_t = pi(a_t) / mu(a_t).
    ppo:       L = -(1/B) sum_t min(rho_t A, clip(rho_t, 1-eps, 1+eps) A)  (mu as the old policy).
    kl:        + kl_coef * (1/B) sum_t [exp(r - l) - (r - l) - 1], l = log pi, r = log pi_ref.
    Returns the loss and summed statistics for ESS and logging: sum_rho, sum_rho2 of the raw importance weights
    rho (the paper's ESS); sum_w, sum_w2 of the weights the update applies (the truncated rho_bar for REINFORCE,
    the unclipped rho for PPO, whose clipping acts on the objective, not on the weights); tokens, kl, clipped.
    `current` (1 on tokens sampled by the weights being trained, lag 0): there rho differs from 1 only by the
    engine/trainer mismatch (kernels, dtype, a wrong tokenizer or template); summed as lag0_tokens, lag0_k3
    (k3 estimate of KL(engine || trainer): rho - 1 - log rho, on the engine's samples) and lag0_abs_log_ratio.
    """
    log_ratio = (logp - behaviour_logp).clamp(max=30.0)  # exp() stays finite for wildly stale tokens
    rho = torch.exp(log_ratio)
    objective = OBJECTIVES.get(settings.kind)
    if objective is None:
        raise ValueError(f"unknown loss kind {settings.kind!r}; registered: {sorted(OBJECTIVES)}")
    out = objective(rho, advantages, logp, settings)
    per_token, clipped, weights = out.loss, out.clipped, out.weights
    loss = (per_token * mask).sum()
    kl_sum = 0.0
    if ref_logp is not None and settings.kl_coef > 0:
        d = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl = torch.exp(d) - d - 1
        loss = loss + settings.kl_coef * (kl * mask).sum()
        kl_sum = float((kl.detach() * mask).sum())
    w, raw = weights * mask, rho.detach() * mask
    stats = {
        "sum_rho": float(raw.sum()),
        "sum_rho2": float((raw * rho.detach()).sum()),
        "sum_w": float(w.sum()),
        "sum_w2": float((w * weights).sum()),
        "tokens": float(mask.sum()),
        "kl": kl_sum,
        "clipped": float((clipped * mask).sum()),
        **lag0_mismatch_sums(log_ratio.detach(), mask * current if current is not None else torch.zeros_like(mask)),
    }
    return loss / num_sequences, stats


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
    logp: torch.Tensor,
    entropy: torch.Tensor,
    micro_batch: dict[str, torch.Tensor],
    num_sequences: float,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss` on one packed micro-batch (`rl.batching.rl_micro_batches`'s fields; `ref_logp` when a
    reference model scored it), with the summed entropy of its counted tokens added to the statistics."""
    mb, mask = micro_batch, micro_batch["mask"][0]
    ref = mb["ref_logp"][0] if "ref_logp" in mb else None
    current = mb["current"][0] if "current" in mb else None
    loss, stats = policy_loss(
        logp[0], mb["behaviour_logp"][0], mb["advantage"][0], mask, num_sequences, settings, ref, current
    )
    stats["entropy"] = float((entropy[0] * mask).sum())
    return loss, stats
