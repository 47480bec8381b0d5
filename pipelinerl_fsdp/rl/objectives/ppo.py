"""PPO-clip with the behaviour policy (the engine's) as the old policy."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective


@dataclass
class PPOConfig(LossConfig):
    name: str = "ppo"
    # the ratio is clipped to [1 - eps_low, 1 + eps_high] (asymmetric: DAPO's clip-higher)
    eps_low: float = 0.2
    eps_high: float = 0.2

    def check(self) -> list[tuple[str, str]]:
        checks = [("eps_low", 0 <= self.eps_low < 1, "in [0, 1)"), ("eps_high", self.eps_high >= 0, ">= 0")]
        return super().check() + [(k, what) for k, ok, what in checks if not ok]


@register_objective("ppo", PPOConfig)
def ppo(t: Tokens, cfg: PPOConfig) -> PerToken:
    """L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) (Schulman et al. 2017, eq. 7), summed over
    tokens / B; the engine's mu is the old policy (PipelineRL's `ppo`)."""
    return clipped_surrogate(t.rho, t.advantages, cfg.eps_low, cfg.eps_high)
