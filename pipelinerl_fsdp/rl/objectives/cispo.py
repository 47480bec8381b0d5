"""CISPO: clipped importance-sampling weights, held constant, so every token keeps its gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelinerl_fsdp.config import LossConfig, Normalization
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, register_objective, weighted_log_likelihood


@dataclass
class CISPOConfig(LossConfig):
    advantage_std: ClassVar[bool] = True  # MiniMax-M1: group-normalised advantages, as GRPO
    name: str = "cispo"
    # the weight is clipped to [1 - eps_low, 1 + eps_high]; eps_low = 1: no lower bound (ScaleRL's and SkyRL's
    # defaults: 1.0 and 4.0). ServiceNow/PipelineRL's current "reinforce" is this with eps_high = 0.02.
    eps_low: float = 1.0
    eps_high: float = 4.0
    normalize: Normalization = "tokens"

    def check(self) -> list[tuple[str, str]]:
        checks = [("eps_low", 0 <= self.eps_low <= 1, "in [0, 1]"), ("eps_high", self.eps_high >= 0, ">= 0")]
        return super().check() + [(k, what) for k, ok, what in checks if not ok]


@register_objective("cispo", CISPOConfig)
def cispo(t: Tokens, cfg: CISPOConfig) -> PerToken:
    """L_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A log pi(a_t) (MiniMax-M1, arXiv 2506.13585, eq. 4):
    unlike PPO, a token whose ratio is clipped still contributes its gradient, at the clipped weight."""
    raw = t.rho.detach()
    w = raw.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    return PerToken(weighted_log_likelihood(w, t.advantages, t.logp), (w != raw).float(), w)
