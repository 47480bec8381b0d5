"""PPO-clip with the behaviour policy as the old policy."""

from __future__ import annotations

import torch

from pipelinerl_fsdp.rl.objectives import LossSettings, PerToken, register_objective


@register_objective("ppo")
def ppo(rho: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, settings: LossSettings) -> PerToken:
    """-min(rho_t A, clip(rho_t, 1-eps, 1+eps) A). Its clipping acts on the objective, so the weights the update
    applies are the unclipped rho."""
    unclipped = rho * advantages
    clipped = rho.clamp(1 - settings.ppo_eps, 1 + settings.ppo_eps) * advantages
    return PerToken(-torch.minimum(unclipped, clipped), (clipped < unclipped).float(), rho.detach())
