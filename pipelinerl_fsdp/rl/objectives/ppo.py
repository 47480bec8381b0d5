"""PPO-clip with the behaviour policy (the engine's) as the old policy."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config import LossConfig, failed
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective


@dataclass
class PPOConfig(LossConfig):
    name: str = "ppo"
    # the ratio is clipped to [1 - eps_low, 1 + eps_high] (asymmetric: DAPO's clip-higher)
    eps_low: float = 0.2
    eps_high: float = 0.2
    # dual-clip PPO: for A < 0 the per-token objective is at least dual_clip x A (c > 1; verl uses 3); 0: off, as
    # PPO's paper defines it. With the engine's log-probs as the old policy and tokens up to rl.max_lag versions
    # old, it bounds what one very stale negative-advantage token can do
    dual_clip: float = 0.0

    def check(self) -> list[tuple[str, str]]:
        return super().check() + failed(
            [
                ("eps_low", 0 <= self.eps_low < 1, "in [0, 1)"),
                ("eps_high", self.eps_high >= 0, ">= 0"),
                ("dual_clip", self.dual_clip == 0 or self.dual_clip > 1, "0 (off) or > 1"),
            ]
        )


@register_objective("ppo", PPOConfig)
def ppo(t: Tokens, cfg: PPOConfig) -> PerToken:
    """L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) (Schulman et al. 2017, eq. 7), summed over
    tokens / B; the engine's mu is the old policy (PipelineRL's `ppo`)."""
    return clipped_surrogate(t.rho, t.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
