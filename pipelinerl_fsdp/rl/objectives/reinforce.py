"""Truncated importance-weighted REINFORCE (the PipelineRL paper's objective, docs/objective.md)."""

from __future__ import annotations

import torch

from pipelinerl_fsdp.rl.objectives import LossSettings, PerToken, register_objective


@register_objective("reinforce")
def reinforce(rho: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, settings: LossSettings) -> PerToken:
    """-sg(min(rho_t, c)) * A * log pi(a_t): the weight is a constant, the gradient flows through log pi."""
    rho_bar = rho.clamp(max=settings.is_clip).detach()
    return PerToken(-rho_bar * advantages * logp, (rho > settings.is_clip).float(), rho_bar)
